"""`learner export`: a trained adapter, out of the store, in the shape other tools load.

The adapter versions a run published sit in its store (`--store`, the embedded default's
`<run dir>/store`) as PEFT's own files, checked here against their manifest's sha256. The
export is a folder that `PeftModel.from_pretrained(base, DIR)` and vLLM's
`--lora-modules name=DIR` load as it is, with a model card naming the base model, the
version and step, and the version's held-out evaluation when the run has one. `--merge`
writes the base model with the adapter merged into it instead (`merge_and_unload`): a full
model folder with the tokenizer, for tools that take no adapters. `--push-to-hub REPO`
uploads the folder with `huggingface_hub` (`HF_TOKEN`, `HF_ENDPOINT` apply).

Which version: `last` (the default: the newest published), `best` (the highest
`eval/pass@1` in the run directory's `evals.jsonl` among the versions still in the
store; the learner keeps the best evaluated version from pruning), or a number.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol import ProtocolError
from protocol.trusted import open_store
from protocol.trusted.store import Store
from protocol.wire.files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, StoreError, StoreMissing, adapter_key, verify


class ExportError(RuntimeError):
    """The export cannot be made as asked; the message says what to change."""


@dataclass(frozen=True)
class Exported:
    path: Path
    version: int
    step: int
    base_model: str
    evaluation: dict[str, Any] | None


def published_versions(store: Store) -> list[int]:
    """Versions whose manifest is in the store (a manifest is written last), oldest first."""
    return sorted(v for v, keys in store.adapter_files().items() if adapter_key(v, MANIFEST) in keys)


def evaluations(run_dir: Path | None) -> dict[int, dict[str, Any]]:
    """The run's finished evaluations by version (`evals.jsonl`), none cut short."""
    path = run_dir / "evals.jsonl" if run_dir is not None else None
    if path is None or not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {int(r["eval/version"]): r for r in rows if not r.get("eval/cut_short") and r.get("eval/pass@1") is not None}


def choose(which: str, available: list[int], evals: dict[int, dict[str, Any]]) -> int:
    if not available:
        raise ExportError("the store holds no published adapter: was --store the run's?")
    if which == "last":
        return available[-1]
    if which == "best":
        scored = {v: e["eval/pass@1"] for v, e in evals.items() if v in available}
        if not scored:
            evaluated = sorted(v for v in evals if v > 0)
            raise ExportError(
                "no evaluated version is in the store"
                + (
                    (
                        f" (evaluated: v{', v'.join(map(str, evaluated))}; in the store: "
                        f"v{', v'.join(map(str, available))})"
                    )
                    if evaluated
                    else "; give --run-dir of a run with evaluations (--eval-every), or a version number"
                )
            )
        return max(scored, key=lambda v: (scored[v], v))  # a tie goes to the later version
    if not which.isdigit() or int(which) < 1:
        raise ExportError(f"--version {which!r}: give last, best or a version number >= 1")
    if int(which) not in available:
        raise ExportError(
            f"adapter v{which} is not in the store (pruned, or never published); "
            f"it holds v{', v'.join(map(str, available))}"
        )
    return int(which)


def export(
    store_url: str,
    out: Path,
    which: str = "last",
    run_dir: Path | None = None,
    *,
    merge: bool = False,
    base_model: str | None = None,
    force: bool = False,
) -> Exported:
    """Write the chosen adapter version (or, with `merge`, the merged model) to `out`."""
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out}: not empty (--force replaces it)")
    store = open_store(store_url)
    try:
        evals = evaluations(run_dir)
        version = choose(which, published_versions(store), evals)
        manifest = store.read_manifest(version)
        files = {}
        for entry in manifest.files:
            data = store.get(adapter_key(version, entry.name))
            verify(entry, data)
            files[entry.name] = data
    except StoreMissing as err:
        raise ExportError(
            f"the store lost part of the adapter while it was read (pruned by a running learner?): {err}"
        ) from None
    except (StoreError, ProtocolError, ValueError) as err:
        raise ExportError(f"--store {store_url}: {err}") from None
    if ADAPTER_WEIGHTS not in files or ADAPTER_CONFIG not in files:
        raise ExportError(f"adapter v{version} lacks {ADAPTER_WEIGHTS} or {ADAPTER_CONFIG}")
    base = base_model or manifest.base_model
    done = Exported(out, version, manifest.step, base, evals.get(version))
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = json.loads(files[ADAPTER_CONFIG])
    config["base_model_name_or_path"] = base
    adapter_dir = partial / "adapter" if merge else partial
    adapter_dir.mkdir(exist_ok=True)
    (adapter_dir / ADAPTER_WEIGHTS).write_bytes(files[ADAPTER_WEIGHTS])
    (adapter_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if merge:
        _merge(base, adapter_dir, partial)
        shutil.rmtree(adapter_dir)
    (partial / "README.md").write_text(model_card(done, merged=merge))
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial.rename(out)
    return done


def _merge(base: str, adapter_dir: Path, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(base)
    except OSError as err:
        raise ExportError(f"the base model {base} does not load here ({err}); give --model") from None
    with warnings.catch_warnings():  # PEFT asks transformers 5 a deprecated question: not the user's business
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out)
    tokenizer.save_pretrained(out)


def hub_id(model: str) -> str | None:
    """`model` if it is a hub id (`org/name`), else the hub id its folder's config names
    (`_name_or_path`), else None: a local path is no base model to the Hub."""
    shaped = re.fullmatch(r"[\w.-]+/[\w.-]+", model)
    folder = Path(model).expanduser()
    if shaped and not folder.exists():
        return model
    try:
        named = json.loads((folder / "config.json").read_text()).get("_name_or_path", "")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", named) else None


def model_card(e: Exported, merged: bool) -> str:
    base = hub_id(e.base_model)
    lines = [
        "---",
        *([f"base_model: {base}"] if base else []),
        "library_name: " + ("transformers" if merged else "peft"),
        "tags:",
        "- grpo",
        "- spotgrpo",
        *([] if merged else ["- lora"]),
        "---",
        "",
        f"# {'Merged model' if merged else 'LoRA adapter'}: spotgrpo adapter v{e.version}",
        "",
        f"Trained with asynchronous GRPO (spotgrpo) on `{e.base_model}`: adapter version {e.version}, "
        f"taken after optimizer step {e.step}.",
        "",
    ]
    if e.evaluation:
        shown = {
            k.removeprefix("eval/"): v for k, v in e.evaluation.items() if k.startswith("eval/") and k != "eval/version"
        }
        lines += [
            "Held-out evaluation of this version:",
            "",
            "| figure | value |",
            "|---|---|",
            *(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in shown.items()),
            "",
        ]
    if merged:
        lines += [
            "```python",
            "from transformers import AutoModelForCausalLM",
            'model = AutoModelForCausalLM.from_pretrained("<this folder>")',
            "```",
        ]
    else:
        lines += [
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            (
                f'model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{e.base_model}"), "<this '
                'folder>")'
            ),
            "```",
            "",
            f"vLLM: `vllm serve {e.base_model} --enable-lora --lora-modules spotgrpo=<this folder>`",
        ]
    return "\n".join(lines) + "\n"


def push_to_hub(
    folder: Path, repo_id: str, *, private: bool = False, token: str | None = None, endpoint: str | None = None
) -> str:
    """Upload the folder to a hub model repository (made if missing); returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message="spotgrpo export"
        )
    except Exception as err:  # the hub library's HTTP and connection errors (their classes vary by version)
        raise ExportError(
            f"the push to {repo_id} failed ({type(err).__name__}: {err}); the export is in {folder}"
        ) from None
    return str(commit.commit_url)
