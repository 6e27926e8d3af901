"""The scoring tier decodes token ids as transformers does, without importing it (or
torch) where that can be done exactly (`learner.detokenize`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from learner.detokenize import load_decode, plain_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("chatml", [False, True])
def test_plain_decode_matches_transformers(chatml: bool, tiny_model: Path, tiny_chatml_model: Path) -> None:
    from transformers import AutoTokenizer

    model = tiny_chatml_model if chatml else tiny_model
    assert plain_tokenizer(str(model)) is not None  # the generic class: the fast path is taken
    reference = AutoTokenizer.from_pretrained(model)
    decode = load_decode(str(model))
    rng = np.random.default_rng(0)
    special = [i for i in reference.all_special_ids if i is not None]
    for _ in range(200):
        ids = rng.integers(0, len(reference), int(rng.integers(0, 40))).tolist()
        ids += rng.choice(special, 3).tolist()  # special tokens among them: skipped by both
        rng.shuffle(ids)
        assert decode(ids) == reference.decode(ids, skip_special_tokens=True)


def _copy(model: Path, tmp_path: Path, **config: object) -> str:
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    data = json.loads((folder / "tokenizer_config.json").read_text())
    data.update(config)
    (folder / "tokenizer_config.json").write_text(json.dumps(data))
    return str(folder)


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer_class": "LlamaTokenizer"},  # a model's own class may rebuild the pipeline
        {"clean_up_tokenization_spaces": True},  # transformers' post-processing
        {"pad_token": "a"},  # a token the config calls special and the file does not
        {"extra_special_tokens": ["b"]},
    ],
)
def test_anything_else_is_left_to_transformers(change: dict[str, object], tiny_model: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_model, tmp_path, **change)
    assert plain_tokenizer(folder) is None
    assert plain_tokenizer(str(tmp_path / "missing")) is None
    (Path(folder) / "tokenizer_config.json").write_text("{not json")
    assert plain_tokenizer(folder) is None


def test_a_scorer_does_not_import_torch(tiny_model: Path) -> None:
    # what makes a work horse's fork cheap: 25-37 ms per fork with torch loaded, 9 without
    code = (
        "import sys; from learner.detokenize import load_decode; import learner.scoring.tier, learner.scoring.cli; "
        f"d = load_decode({str(tiny_model)!r}); d([5, 6, 7]); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
