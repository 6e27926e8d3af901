"""`learner export`: an adapter version out of the store as a PEFT folder (and merged),
loaded by PEFT, generating what the actor's engine generated with that version; `best`
by the run's evaluations; a push to a hub, against a local hub endpoint."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from rollouts import perturbed_policy

from actors.hf_engine import TransformersEngine
from learner.publish import Publisher, PublishJob
from protocol import SamplingParams
from protocol.trusted import open_store

REPO = Path(__file__).resolve().parents[1]


class _Announcements:
    def announce(self, manifest) -> str:
        return "0-1"


@pytest.fixture(scope="module")
def published(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with a store holding adapters v1..v3 (v2 the best evaluated)."""
    run_dir = tmp_path_factory.mktemp("run")
    store = open_store((run_dir / "store").as_uri())
    publisher = Publisher(store, _Announcements(), base_model=str(tiny_model), rank=4)
    for version in (1, 2, 3):
        policy = perturbed_policy(tiny_model, version)
        publisher.submit(PublishJob(version, version * 10, policy.adapter_state(), policy.adapter_config_json()))
    publisher.close()
    assert publisher.published == [1, 2, 3]
    (run_dir / "evals.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"step": 0, "eval/version": 0, "eval/pass@1": 0.1},
                {"step": 10, "eval/version": 2, "eval/pass@1": 0.6},
                {"step": 20, "eval/version": 3, "eval/pass@1": 0.4},
                {"step": 20, "eval/version": 4, "eval/pass@1": 0.9, "eval/cut_short": 1},
            ]
        )
    )
    return run_dir


def _export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "learner.cli", "export", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _greedy(model, prompt: list[int], n: int = 8) -> list[int]:
    """Greedy tokens up to and including the first EOS, as the engine returns them."""
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=n,
        eos_token_id=2,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    return tokens[: tokens.index(2) + 1] if 2 in tokens else tokens


def test_an_exported_adapter_loads_in_peft_and_generates_what_the_actor_did(
    published: Path, tiny_model: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    proc = _export("--run-dir", str(published), "--version", "2", "--out", str(tmp_path / "v2"))
    assert proc.returncode == 0, proc.stderr
    assert "adapter v2 (step 20" in proc.stdout
    out = tmp_path / "v2"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model)
    card = (out / "README.md").read_text()
    assert "pass@1 | 0.6" in card
    assert "base_model:" not in card.split("---")[1]  # a local path is no hub metadata (the text still names it)

    engine = TransformersEngine(str(tiny_model))
    engine.load_adapter(2, published / "store" / "adapters" / "v2")
    prompt = engine.tokenizer("abcde:", add_special_tokens=True)["input_ids"]
    assert engine.stop_ids == (2,)
    (actor,) = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_tokens=8), 2)

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(out)).eval()
    assert _greedy(peft, prompt) == actor[0].token_ids
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    (actor_v0,) = engine.generate([prompt], 1, SamplingParams(temperature=0.0, max_tokens=8), 0)
    assert _greedy(base, prompt) == actor_v0[0].token_ids != actor[0].token_ids  # the adapter matters

    merged_dir = tmp_path / "merged"
    proc = _export("--run-dir", str(published), "--version", "2", "--out", str(merged_dir), "--merge")
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr  # transformers' and PEFT's are not the user's business
    assert (merged_dir / "config.json").exists() and (merged_dir / "tokenizer.json").exists()
    assert not (merged_dir / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert _greedy(merged, prompt) == actor[0].token_ids


def test_the_version_is_last_best_or_a_number_and_bad_choices_are_named(published: Path, tmp_path: Path) -> None:
    proc = _export("--run-dir", str(published), "--out", str(tmp_path / "last"))
    assert proc.returncode == 0 and "adapter v3 " in proc.stdout, proc.stderr
    # best: v2 (0.6); v4's 0.9 was cut short and is not in the store anyway
    proc = _export("--run-dir", str(published), "--version", "best", "--out", str(tmp_path / "best"))
    assert proc.returncode == 0 and "adapter v2 " in proc.stdout, proc.stderr
    for args, words in [
        (["--version", "7", "--out", str(tmp_path / "x")], ["v7 is not in the store", "v1, v2, v3"]),
        (["--version", "newest", "--out", str(tmp_path / "x")], ["last, best or a version number"]),
        (["--out", str(tmp_path / "last")], ["not empty", "--force"]),
    ]:
        proc = _export("--run-dir", str(published), *args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert all(w in proc.stderr for w in words), proc.stderr
    assert not (tmp_path / "x").exists()
    proc = _export("--store", (tmp_path / "empty").as_uri(), "--out", str(tmp_path / "y"))
    assert proc.returncode == 2 and "no published adapter" in proc.stderr


class FakeHub:
    """The hub's upload API as huggingface_hub calls it (create a repo, pre-upload, commit),
    on loopback: every request is recorded and every committed file kept."""

    def __init__(self) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        self.requests: list[tuple[str, str]] = []
        self.files: dict[str, bytes] = {}

        async def record(request: Request) -> JSONResponse:
            path = request.url.path
            self.requests.append((request.method, path))
            if path == "/api/repos/create":
                body = await request.json()
                return JSONResponse({"url": f"{self.url}/{body.get('organization')}/{body['name']}"})
            if path == "/api/validate-yaml":
                return JSONResponse({})
            if path.endswith("/preupload/main"):
                files = (await request.json())["files"]
                return JSONResponse(
                    {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]}
                )
            if path.endswith("/commit/main"):
                for line in (await request.body()).decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        self.files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                return JSONResponse({"commitUrl": f"{self.url}/me/model/commit/{'a' * 40}", "commitOid": "a" * 40})
            return JSONResponse({"error": "not found"}, status_code=404)

        app = Starlette(routes=[Route("/{path:path}", record, methods=["GET", "POST", "PUT", "HEAD"])])
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_push_to_hub_uploads_the_exported_folder(published: Path, tmp_path: Path) -> None:
    hub = FakeHub()
    try:
        out = tmp_path / "pushed"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "learner.cli",
                "export",
                "--run-dir",
                str(published),
                "--out",
                str(out),
                "--push-to-hub",
                "me/model",
                "--private",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **os.environ,
                "PYTHONPATH": str(REPO),
                "HF_ENDPOINT": hub.url,
                "HF_TOKEN": "hf_test",
                "HF_HUB_DISABLE_TELEMETRY": "1",
            },
        )
        assert proc.returncode == 0, proc.stderr
        assert f"pushed: {hub.url}/me/model/commit/" in proc.stdout
        assert ("POST", "/api/repos/create") in hub.requests
        assert hub.files == {p.name: p.read_bytes() for p in out.iterdir()}  # every file, byte for byte
    finally:
        hub.close()
    # the hub gone: one line, and the export stays where it was written
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner.cli",
            "export",
            "--run-dir",
            str(published),
            "--out",
            str(tmp_path / "again"),
            "--push-to-hub",
            "me/model",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": "hf_test",
            "HF_HUB_ETAG_TIMEOUT": "1",
            "HF_HUB_DOWNLOAD_TIMEOUT": "1",
        },
    )
    assert proc.returncode == 2 and "the push to me/model failed" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "again" / "adapter_model.safetensors").exists()


def test_the_model_cards_base_model_is_a_hub_id_or_left_out(tmp_path: Path) -> None:
    from learner.export import hub_id

    assert hub_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    folder = tmp_path / "smol"
    folder.mkdir()
    assert hub_id(str(folder)) is None  # no config to say where it came from
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    assert hub_id(str(folder)) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "/models/elsewhere/smol"}))
    assert hub_id(str(folder)) is None
