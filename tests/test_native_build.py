"""The native CPU kernels' build survives a builder killed half-way (stale lock files)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from kernels import cpu_ops


def test_exclusive_waits_for_a_holder_and_gives_up_at_its_deadline(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "build.flock")
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with cpu_ops._exclusive(path, wait_s=0.3) as held:
            assert held is False
    finally:
        os.close(holder)  # the kernel drops the flock with its last descriptor
    with cpu_ops._exclusive(path, wait_s=0.3) as held:
        assert held is True


def test_stale_torch_lock_file_does_not_block_the_build(tmp_path: object) -> None:
    if not cpu_ops.native_available():
        pytest.skip("no C++ toolchain here: the native kernels cannot be built")
    # A build killed mid-way leaves torch's plain 'lock' file behind; torch waits on it forever.
    child = (
        "import logging, sys\n"
        "logging.basicConfig()\n"
        "from kernels import cpu_ops\n"
        "sys.exit(0 if cpu_ops.native_available() else 3)\n"
    )
    probe = "from kernels import cpu_ops; print(cpu_ops._build_directory(cpu_ops._extension_name()))"
    build_dir = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    stale = os.path.join(build_dir, "lock")
    open(stale, "w").close()
    planted = os.stat(stale).st_mtime_ns
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # Gone, or a newer one: another process on this machine building or loading right now.
    assert not os.path.exists(stale) or os.stat(stale).st_mtime_ns > planted


def test_package_data_ships_every_kernel_source() -> None:
    """A non-editable install (the Docker image's `pip install .`) builds the kernels from
    the installed files: every source and header in kernels/csrc must be package data."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kernels"]
    files = sorted(p.relative_to(root / "kernels").as_posix() for p in (root / "kernels" / "csrc").iterdir())
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert files and not missing, f"not in [tool.setuptools.package-data] kernels: {missing}"
    sources = {os.path.basename(s) for s in cpu_ops._SOURCES}
    assert sources == {os.path.basename(f) for f in files if f.endswith(".cpp")}, "a .cpp file is not built"


def test_the_isa_path_is_chosen_by_env_and_builds_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_CPU_ISA", raising=False)
    assert cpu_ops.cpu_isa() == "native"
    native = cpu_ops._extension_name()
    monkeypatch.setenv("TANDEM_CPU_ISA", "AVX2")
    assert cpu_ops.cpu_isa() == "avx2"
    assert cpu_ops._extension_name() == native + "_avx2"  # its own build, beside the native one
    monkeypatch.setenv("TANDEM_CPU_ISA", "avx9")
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA"):
        cpu_ops.cpu_isa()
