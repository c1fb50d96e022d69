"""deploy/compose_check.py (``make compose-check``): its skip, its inputs, its build context.

The check itself builds both images and runs the compose stack (a cold build takes minutes),
so it runs here only when asked: ``TANDEM_COMPOSE_CHECK=1`` (with its own TANDEM_* inputs,
see deploy/README.md). What is tested always: it skips, saying why and exiting 0, where no
Docker engine can run; machine-specific inputs become build flags only when given; the build
context holds what the Dockerfile copies, plus the CA bundle and wheels given, and the
working tree stays untouched.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy_helpers import ROOT, dockerfile_global_args, dockerfile_stages

SCRIPT = ROOT / "deploy" / "compose_check.py"
INPUTS = ("TANDEM_BASE_IMAGE", "TANDEM_BUILD_NETWORK", "TANDEM_BUILD_CA_BUNDLE", "TANDEM_BUILD_WHEELS",
          "TANDEM_PIP_INDEX_URL", "TANDEM_PIP_EXTRA_INDEX_URL", "TANDEM_TORCH_INDEX_URL",
          "TANDEM_DOCKERD_ARGS")


def _module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import compose_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return compose_check


def _run(path_dirs: list[Path], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in INPUTS}
    clean.update(env, PATH=os.pathsep.join(str(d) for d in path_dirs))
    return subprocess.run([sys.executable, str(SCRIPT)], env=clean, capture_output=True, text=True,
                          timeout=120)


def _fake(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _assert_skipped(proc: subprocess.CompletedProcess[str], why: str) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "skip" in line]
    assert len(lines) == 1 and why in lines[0], proc.stdout
    assert lines[0].startswith("compose-check: skip: ")


def test_without_a_docker_cli(tmp_path: Path) -> None:
    _assert_skipped(_run([tmp_path]), "no docker CLI")


def test_where_no_engine_answers_and_none_can_start(tmp_path: Path) -> None:
    _fake(tmp_path, "docker", "exit 1")  # a CLI whose daemon does not answer; no dockerd
    _assert_skipped(_run([tmp_path]), "dockerd is not installed")


@pytest.mark.skipif(os.geteuid() != 0, reason="starts a (fake) dockerd only as root")
def test_when_dockerd_will_not_start(tmp_path: Path) -> None:
    """dockerd exits at once with every flag set tried: a skip, not a failure."""
    _fake(tmp_path, "docker", "exit 1")
    _fake(tmp_path, "dockerd", "exit 1")
    proc = _run([tmp_path], TANDEM_DOCKERD_ARGS="--bogus")
    _assert_skipped(proc, "dockerd could not be started")
    assert "dockerd --bogus" in proc.stdout


def test_inputs_become_build_flags_only_when_given(monkeypatch: pytest.MonkeyPatch) -> None:
    cc = _module()
    for name in INPUTS:
        monkeypatch.delenv(name, raising=False)
    assert cc.build_args(cc.parse_args([])) == []
    monkeypatch.setenv("TANDEM_BASE_IMAGE", "local/python:3.11")
    monkeypatch.setenv("TANDEM_BUILD_NETWORK", "host")
    monkeypatch.setenv("TANDEM_PIP_INDEX_URL", "https://mirror.example/simple")
    monkeypatch.setenv("TANDEM_TORCH_INDEX_URL", "")  # set but empty: no separate torch index
    flags = cc.build_args(cc.parse_args([]))
    assert shlex.join(flags) == (
        "--network host --build-arg BASE_IMAGE=local/python:3.11 "
        "--build-arg PIP_INDEX_URL=https://mirror.example/simple --build-arg TORCH_INDEX_URL="
    )
    # The Dockerfile declares every build argument the script passes.
    declared = {a.split("=")[0] for s in dockerfile_stages().values() for a in s.args("ARG")}
    declared |= set(dockerfile_global_args())  # BASE_IMAGE, before the first FROM
    passed = {f.split("=")[0] for f in flags if "=" in f}
    assert passed <= declared, passed - declared


def test_build_context_holds_what_the_dockerfile_copies(tmp_path: Path) -> None:
    cc = _module()
    ca = tmp_path / "proxy-ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot a real one\n-----END CERTIFICATE-----\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"PK")
    before = sorted(p.name for p in (ROOT / "deploy" / "wheels").iterdir())
    args = cc.parse_args(["--ca-bundle", str(ca), "--wheels", str(wheels)])
    with cc.build_context(args) as ctx:
        for stage in dockerfile_stages().values():
            for rest in stage.args("COPY"):
                if not rest.startswith("--from"):
                    for src in shlex.split(rest)[:-1]:
                        assert (ctx / src).exists(), f"COPY {src}: not in the build context"
        assert (ctx / "deploy/build-ca/compose-check-extra.crt").read_text() == ca.read_text()
        assert (ctx / "deploy/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").exists()
        assert not list(ctx.rglob("__pycache__"))
    assert not ctx.exists()
    assert sorted(p.name for p in (ROOT / "deploy" / "wheels").iterdir()) == before


def test_the_compose_stack_for_real() -> None:
    """The whole check: builds, compose up, streams, engine kill, drain, teardown."""
    if os.environ.get("TANDEM_COMPOSE_CHECK") != "1":
        pytest.skip("set TANDEM_COMPOSE_CHECK=1 to build the images and run the stack (make compose-check)")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=3600)
    print(proc.stdout)
    if "compose-check: skip:" in proc.stdout:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and "compose-check: passed" in proc.stdout, proc.stdout[-8000:] + proc.stderr
