"""`learner check`: the trusted side's preflight, with the flags of `learner run`: the
queue (Redis, or the proxy with a learner token), the store (a probe written, read back
and deleted), the data set (loaded, its first prompt built), the model (config and
tokenizer; its fingerprint is what workers are checked against) and the reward
functions (importable here, where the scorers or the embedded actors run them)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import msgspec

from learner.config import LearnerConfig
from protocol import Progress
from protocol.util.checks import CheckFailed, Checks


def check(cfg: LearnerConfig) -> int:
    from protocol import (
        QueueConfig,
        QueueForbidden,
        QueueTLSError,
        QueueUnavailable,
        StoreError,
        check_model_path,
        fingerprint_of_model,
    )
    from protocol.trusted import open_queue, open_store

    state: dict[str, Any] = {}

    def embedded() -> str:
        """No --queue: what `learner run` would start here, prepared as it prepares it (the
        run directory, the built-in model and data where none is given, the certificate
        and tokens), so the checks after this one see the run's own settings."""
        nonlocal cfg
        from learner.cli import check_run_dir
        from learner.embedded import import_user_code, prepare, redis_server_binary

        try:
            check_run_dir(cfg.resolved_run_dir)
            redis = redis_server_binary(cfg.embedded_redis)
            cfg, _ = prepare(cfg)
        except FileNotFoundError as err:
            raise CheckFailed(str(err), "give the model's folder, or a hub id this machine can download") from None
        except (ValueError, OSError) as err:
            raise CheckFailed(str(err), "see `learner run --help` for the embedded run's flags") from None
        try:
            import_user_code(cfg)
        except ValueError as err:  # RewardError, ToolError
            unimported = "cannot import" in str(err) or "has no function" in str(err)
            fix = (
                "run from the folder that holds your module (it is on the module path), or install it"
                if unimported
                else "correct the specification as the line says (module:function, or module:factory(name=value, ...))"
            )
            raise CheckFailed(str(err), fix) from None
        return (
            f"no --queue: `learner run` starts the whole system here in {cfg.resolved_run_dir}: "
            f"{'redis-server ' + redis if redis else 'an in-process Redis (fakeredis)'}, the proxy over TLS on "
            f"loopback, {cfg.actors} {cfg.actor_engine} actor(s)"
            + (", a `learner score` worker" if cfg.scoring_mode == "trusted" else "")
        )

    def queue() -> str:
        try:
            q = open_queue(cfg.queue, QueueConfig(run=cfg.run), cfg.token, retry_s=5.0, stop=threading.Event())
            state["queue"] = q
            stats = q.stats()
        except QueueTLSError as err:
            raise CheckFailed(str(err), "give the proxy's CA certificate: SPOTGRPO_CA_CERT=cert.pem") from None
        except QueueForbidden as err:
            raise CheckFailed(str(err), "use a token with role learner (--token or SPOTGRPO_TOKEN)") from None
        except QueueUnavailable as err:
            raise CheckFailed(
                str(err), f"is {cfg.queue} reachable from here, and Redis (or the proxy) running?"
            ) from None
        except ValueError as err:
            raise CheckFailed(str(err), "--queue takes redis://host:port/db or https://proxy:port") from None
        return (
            f"{cfg.queue}: run {cfg.run!r} has {stats.prompts.length} prompt batches, {stats.rollouts.length} "
            f"groups queued, adapter v{stats.latest_adapter_version}"
        )

    def store() -> str:
        if not cfg.store:
            raise CheckFailed("no --store", "give --store s3://bucket/prefix or file:///dir")
        key = f"checks/probe-{uuid.uuid4().hex}.json"
        try:
            s = open_store(cfg.store)
            s.put(key, b'{"probe": true}')
            if s.get(key) != b'{"probe": true}':
                raise StoreError("the probe read back differs from what was written")
            s.delete([key])
        except (StoreError, ValueError, OSError) as err:
            raise CheckFailed(
                f"--store {cfg.store}: {err}",
                "check the bucket, its credentials (AWS_* variables, "
                "AWS_ENDPOINT_URL for MinIO/R2) and write permission",
            ) from None
        return f"{cfg.store}: a probe written, read back and deleted"

    def model() -> str:
        if not cfg.model:
            raise CheckFailed("no --model", "give --model <hub id or path>")
        try:
            check_model_path(cfg.model)
        except FileNotFoundError as err:  # it names the flag and the path itself
            raise CheckFailed(str(err), "give the model's folder, or a hub id this machine can download") from None
        try:
            state["fingerprint"] = fingerprint_of_model(cfg.model)
        except (OSError, ValueError) as err:
            raise CheckFailed(
                f"--model {cfg.model}: {err}", "give a hub id this machine can download, or a path"
            ) from None
        return f"{cfg.model}: config and tokenizer load (fingerprint {state['fingerprint']})"

    def tools() -> str:
        if not cfg.tools and not cfg.environment:
            return "none given: one completion per sample"
        from transformers import AutoTokenizer

        from learner.data import DataError, ModelCannotOfferTools, episode_tools

        try:
            made = episode_tools(cfg, AutoTokenizer.from_pretrained(cfg.model))
        except ModelCannotOfferTools as err:
            raise CheckFailed(str(err), err.fix) from None
        except DataError as err:
            raise CheckFailed(
                str(err),
                "a tool is a typed function whose docstring documents every argument (as "
                "TRL's tools), importable here and on the actors",
            ) from None
        assert made is not None
        offered = (
            "the model's own chat template"
            if made.template is None
            else "Qwen2.5's ChatML tool template (the model's has no tools section)"
        )
        environment = f" (the environment {made.environment}'s methods among them)" if made.environment else ""
        return (
            f"{', '.join(made.names)}{environment}: schemas built, offered with {offered}; start the actors with "
            "the same --tools and --environment"
        )

    def dataset() -> str:
        if not cfg.dataset:
            raise CheckFailed("no --dataset", "give --dataset <hub id or .jsonl/.json/.parquet file>")
        from learner.data import DataError, DoesNotFit, open_sources_for

        try:
            source = open_sources_for(cfg)[0]
            state["source"], rows = source, source.rows
        except DoesNotFit as err:
            raise CheckFailed(err.reason, err.fix) from None
        except DataError as err:
            raise CheckFailed(getattr(err, "reason", str(err)), err.fix) from None
        except (ValueError, OSError, KeyError) as err:
            raise CheckFailed(
                f"--dataset {cfg.dataset}: {err}", "check --dataset-config, --dataset-split and --prompt-column"
            ) from None
        columns = sorted(k for k in rows[0] if k != cfg.prompt_column)
        return f"{cfg.dataset}: {len(rows)} rows; prompt column {cfg.prompt_column!r}, other columns {columns}"

    def rewards() -> str:
        """Each reward imports here and scores a real row of the data set (two made-up
        completions): a function that wants a column the data set lacks, or an argument
        nobody passes, fails now, not on every group of the run."""
        if not cfg.reward:
            return "none given: the actors score with their own (--scoring actors)"
        from protocol.usercode.rewards import RewardError, Scorer, load_reward

        try:
            scorer = Scorer([load_reward(spec) for spec in cfg.reward_specs], timeout_s=60.0)
        except RewardError as err:
            fix = (
                "install the reward's package on the trusted side (where `learner score` runs)"
                if "cannot import" in str(err)
                else "give module:function (or module.function), as in TRL"
            )
            raise CheckFailed(str(err), fix) from None
        source = state.get("source")
        if source is None:
            return f"{', '.join(cfg.reward)} import (no data set row to score them on)"
        # as the run hands it: with the trainer state of its first step
        prompt = msgspec.structs.replace(
            source.prompt(0), progress=Progress(global_step=0, max_steps=cfg.steps, epoch=0.0)
        )
        scores = scorer.score(prompt, "", ["0", "The answer is 42."], [[0], [1]])
        if scores.error is not None and "abstained" not in scores.error:
            raise CheckFailed(
                f"on the data set's first row: {scores.error}",
                "the reward is called as in TRL: fn(prompts, completions, completion_ids, "
                "trainer_state, log_metric, log_extra, **columns); the data set's columns are "
                f"{sorted(prompt.columns)}",
            )
        return (
            f"{', '.join(cfg.reward)} import and score the data set's first row; scored by {cfg.scoring_mode} "
            f"({'learner score' if cfg.scoring_mode == 'trusted' else 'the workers'})"
        )

    checks = Checks()
    try:
        return checks.run_all(
            [
                ("queue", queue) if cfg.queue else ("embedded", embedded),
                ("store", store),
                ("model", model),
                ("tools", tools),
                ("dataset", dataset),
                ("rewards", rewards),
            ],
            "`learner run` with these flags is ready",
        )
    finally:
        if "queue" in state:
            state["queue"].close()
