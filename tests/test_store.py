"""The object store on file:// and on a real S3 API (moto over HTTP), and publishing
adapters to both: manifests whose checksums verify, written last."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import torch

from protocol import AdapterManifest, ProtocolError, from_json
from protocol.trusted.store import FileStore, Store, open_store, retrying
from protocol.wire.files import MANIFEST, StoreError, StoreMissing, adapter_key, check_key, verify


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "file":
        return open_store((tmp_path / "store").as_uri())
    request.applymarker(pytest.mark.s3)
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/runs/one")


def test_put_get_list_delete(store: Store) -> None:
    store.put("adapters/v1/a.bin", b"one")
    store.put("adapters/v1/b.bin", b"two")
    store.put("adapters/v2/a.bin", b"three")
    store.put("adapters/v1/a.bin", b"uno")  # overwrite is whole-object
    assert store.get("adapters/v1/a.bin") == b"uno"
    assert store.exists("adapters/v1/b.bin") and not store.exists("adapters/v9/x")
    assert store.list("adapters/v1/") == ["adapters/v1/a.bin", "adapters/v1/b.bin"]
    assert len(store.list("adapters/")) == 3
    store.delete(["adapters/v1/a.bin", "adapters/v1/b.bin"])
    assert store.list("adapters/v1/") == []
    with pytest.raises(StoreMissing):
        store.get("adapters/v1/a.bin")


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b", ".hidden", "a//b", "", "a/./b"])
def test_keys_cannot_leave_the_prefix(store: Store, key: str) -> None:
    with pytest.raises(ValueError, match="plain relative path"):
        store.put(key, b"x")
    with pytest.raises(ValueError):
        check_key(key)


def test_store_urls() -> None:
    with pytest.raises(ValueError, match="bucket"):
        open_store("s3://")
    with pytest.raises(ValueError, match="file:///path or s3://"):
        open_store("gs://bucket/x")
    with pytest.raises(ValueError, match="absolute path"):
        open_store("file://host/dir")


@pytest.mark.s3
def test_s3_presigned_url_fetches_without_credentials(s3_bucket: str) -> None:
    store = open_store(f"s3://{s3_bucket}/p")
    store.put("adapters/v1/adapter_model.safetensors", b"weights")
    url = store.presign("adapters/v1/adapter_model.safetensors", expires_s=60)
    assert url is not None and "Signature" in url
    with urllib.request.urlopen(url) as response:  # plain HTTP, no AWS credentials involved
        assert response.read() == b"weights"


@pytest.mark.s3
def test_s3_outage_raises_store_error_and_retrying_gives_up(monkeypatch: pytest.MonkeyPatch, s3_bucket: str) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    store = open_store(f"s3://{s3_bucket}")
    calls = []
    with pytest.raises(StoreError, match="gave up after 2 attempts"):
        retrying(lambda: calls.append(1) or store.put("k", b"x"), what="put k", attempts=2, base_s=0.01)
    assert len(calls) == 2


def test_retrying_does_not_retry_a_missing_key(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    calls = []
    with pytest.raises(StoreMissing):
        retrying(lambda: calls.append(1) or store.get("nope"), what="get", attempts=5, base_s=0.01)
    assert calls == [1]


# ------------------------------------------------------------------ publishing


def _publish_one(store: Store, tiny_model: Path, version: int = 1) -> AdapterManifest:
    from learner.config import LearnerConfig
    from learner.policy import Policy
    from learner.publish import Publisher, PublishJob

    class AnnouncedOnly:  # records announcements; the queue itself is tested elsewhere
        def __init__(self) -> None:
            self.announced: list[AdapterManifest] = []

        def announce(self, manifest: AdapterManifest) -> str:
            self.announced.append(manifest)
            return "1-0"

    policy = Policy(LearnerConfig(model=str(tiny_model), lora_rank=4))
    queue = AnnouncedOnly()
    publisher = Publisher(store, queue, base_model=str(tiny_model), rank=4)
    publisher.submit(PublishJob(version, 3, policy.adapter_state(), policy.adapter_config_json()))
    publisher.close()
    assert publisher.failures == 0 and publisher.published == [version]
    assert [m.version for m in queue.announced] == [version]
    return queue.announced[0]


@pytest.mark.parametrize("kind", ["file", pytest.param("s3", marks=pytest.mark.s3)])
def test_published_adapter_manifest_verifies(
    kind: str, tmp_path: Path, tiny_model: Path, request: pytest.FixtureRequest
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    url = (tmp_path / "s").as_uri() if kind == "file" else f"s3://{request.getfixturevalue('s3_bucket')}/run"
    store = open_store(url)
    announced = _publish_one(store, tiny_model, version=7)
    manifest = from_json(store.get(adapter_key(7, MANIFEST)))
    assert isinstance(manifest, AdapterManifest) and manifest == announced
    assert manifest.step == 3 and manifest.rank == 4
    assert {f.name for f in manifest.files} == {"adapter_model.safetensors", "adapter_config.json"}
    local = tmp_path / "download"
    local.mkdir()
    for entry in manifest.files:
        data = store.get(adapter_key(7, entry.name))
        verify(entry, data)  # size and sha256
        (local / entry.name).write_bytes(data)
        with pytest.raises(ProtocolError, match="sha256"):
            verify(entry, data[:-1] + bytes([data[-1] ^ 1]))
    config = json.loads((local / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == str(tiny_model)
    # PEFT loads what was published
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), local)
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_failing_store_does_not_announce(tmp_path: Path, tiny_model: Path) -> None:
    from learner.config import LearnerConfig
    from learner.policy import Policy
    from learner.publish import Publisher, PublishJob

    class BrokenStore(FileStore):
        """Fails every write of a manifest, as a store mid-outage would."""

        def put(self, key: str, data: bytes) -> None:
            if key.endswith(MANIFEST):
                raise StoreError("503 Slow Down")
            super().put(key, data)

    class Announcements:
        def __init__(self) -> None:
            self.versions: list[int] = []

        def announce(self, manifest: AdapterManifest) -> str:
            self.versions.append(manifest.version)
            return "1-0"

    policy = Policy(LearnerConfig(model=str(tiny_model), lora_rank=2))
    queue = Announcements()
    publisher = Publisher(BrokenStore(tmp_path), queue, base_model="m", rank=2, attempts=2, backoff_s=0.01)
    publisher.submit(PublishJob(1, 1, policy.adapter_state(), policy.adapter_config_json()))
    publisher.flush()
    assert publisher.failures == 1 and publisher.published == [] and queue.versions == []
    assert not (tmp_path / "adapters/v1" / MANIFEST).exists()
    publisher.close()


def test_publisher_reraises_a_bug_on_the_training_thread(tmp_path: Path) -> None:
    from learner.publish import Publisher, PublishJob

    publisher = Publisher(FileStore(tmp_path), None, base_model="m", rank=1)
    publisher.submit(PublishJob(1, 1, {"w": torch.zeros(2)}, b"not json config"))  # no queue: AttributeError
    with pytest.raises(RuntimeError, match="publisher died"):
        publisher.close()


def test_old_adapter_versions_are_pruned_except_the_pinned_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest `keep_adapters` stay, and any version something pins (an evaluation in
    progress, a kept checkpoint's), however old; the rest go, a skipped one at a later publish.
    Publishes and prunes are said at info every `log_every` steps (logging_steps) only."""
    import logging

    from learner.publish import Publisher, PublishJob

    class Announced:
        def announce(self, manifest: AdapterManifest) -> str:
            return "1-0"

    store = FileStore(tmp_path)
    pinned = {2}
    state = {"w": torch.zeros(2)}
    publisher = Publisher(
        store, Announced(), base_model="m", rank=1, keep_adapters=3, protected=lambda: set(pinned), log_every=5
    )
    with caplog.at_level(logging.INFO, logger="learner.publish"):
        for version in range(1, 8):
            publisher.submit(PublishJob(version, version, state, b"{}"))
            publisher.flush()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == ["adapter v5 published (step 5)"], said  # v1 went at step 4, unsaid
    versions = sorted({int(k.split("/")[1][1:]) for k in store.list("adapters/")})
    assert versions == [2, 5, 6, 7]
    pinned.clear()  # the evaluation of v2 is done
    publisher.submit(PublishJob(8, 8, state, b"{}"))
    publisher.close()
    assert sorted({int(k.split("/")[1][1:]) for k in store.list("adapters/")}) == [6, 7, 8]
    assert store.exists(adapter_key(8, MANIFEST))


def test_the_default_retention_keeps_what_actors_may_still_use() -> None:
    from learner.config import LearnerConfig

    assert LearnerConfig(max_staleness=4).adapters_kept == 6
    assert LearnerConfig(keep_adapters=0).adapters_kept == 0  # keep all
