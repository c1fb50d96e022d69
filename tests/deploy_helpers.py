"""Readers shared by the deployment checks (tests/test_deploy.py, tests/test_deploy_k8s.py).

The Dockerfile is split into its build stages, and a container's command is parsed with
the real ``tandem`` argument parser under the container's environment, so every flag and
every ``TANDEM_*`` variable is resolved exactly as the service would resolve it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from tandem.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"

# TANDEM_* variables that feed a flag whose name is not derived from the variable's.
ENV_FLAG_ALIASES = {"TANDEM_ENGINES": "--engine"}


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path.name}: not a mapping"
    return data


def split_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    assert sep and host and port.isdigit(), f"not HOST:PORT: {addr!r}"
    return host, int(port)


# ---- the Dockerfile, stage by stage ----------------------------------------------------------


@dataclass
class Stage:
    """One ``FROM ... AS name`` build stage and its instructions (comments dropped)."""

    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for rest in self.args("ENV"):
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"use ENV KEY=VALUE, got {item!r}"
                env[key] = value
        return env


def dockerfile_instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (DOCKERFILE.read_text() if text is None else text).splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a line continuation"
    return out


def dockerfile_global_args() -> dict[str, str]:
    """The ``ARG NAME[=default]`` lines before the first FROM (usable in FROM lines)."""
    out: dict[str, str] = {}
    for keyword, rest in dockerfile_instructions():
        if keyword == "FROM":
            break
        assert keyword == "ARG", f"only ARG may come before the first FROM, got {keyword}"
        name, _, default = rest.partition("=")
        out[name] = default
    return out


def dockerfile_stages() -> dict[str, Stage]:
    """Stages by name, in file order; every stage is named (``FROM image AS name``). Global
    ARGs (before the first FROM) are in :func:`dockerfile_global_args`."""
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for keyword, rest in dockerfile_instructions():
        if keyword == "ARG" and current is None:
            continue
        if keyword == "FROM":
            words = rest.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"name every stage: FROM {rest}"
            assert words[2] not in stages, f"stage {words[2]} defined twice"
            current = stages[words[2]] = Stage(words[2], words[0])
        else:
            assert current is not None, f"{keyword} before the first FROM"
            current.instructions.append((keyword, rest))
    return stages


def stage_chain(stages: Mapping[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    chain = [stages[name]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def chain_env(stages: Mapping[str, Stage], name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for stage in reversed(stage_chain(stages, name)):
        env.update(stage.env())
    return env


def exec_form(rest: str) -> list[str]:
    cmd = json.loads(rest)  # exec form, so signals reach tandem
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd), rest
    return cmd


def health_probe(stage: Stage) -> tuple[str, str]:
    """(python -c source, address) of the stage's HEALTHCHECK."""
    (check,) = stage.args("HEALTHCHECK")
    _, _, form = check.partition("CMD ")
    cmd = exec_form(form)
    assert cmd[:2] == ["python", "-c"] and len(cmd) == 4, cmd
    return cmd[2], cmd[3]


# ---- tandem commands ---------------------------------------------------------------------------


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@contextmanager
def service_env(env: Mapping[str, Any]) -> Iterator[None]:
    """os.environ as the container sees it (for TANDEM_* / OTEL_* defaults)."""
    with mock.patch.dict(os.environ):
        for key in [k for k in os.environ if k.startswith(("TANDEM_", "OTEL_"))]:
            del os.environ[key]
        os.environ.update({k: str(v) for k, v in env.items()})
        yield


def parse_command(command: Sequence[str], env: Mapping[str, Any]) -> argparse.Namespace:
    """Parse a container command with the real CLI, defaults read from ``env``."""
    assert command[0] == "tandem", f"command must run the tandem CLI: {command}"
    assert command[1] in subparsers(), f"unknown subcommand {command[1]!r}"
    # Whole flag names only: argparse would also take a unique prefix (`--kv-rol`), which a
    # later flag sharing that prefix would silently turn into an error.
    options = subparsers()[command[1]]._option_string_actions
    for word in command[2:]:
        flag = word.partition("=")[0]
        assert not flag.startswith("--") or flag in options, f"`tandem {command[1]}` has no {flag}"
    with service_env(env):
        try:
            return build_parser().parse_args(list(command[1:]))
        except SystemExit as exc:  # argparse rejects an unknown flag or bad value
            raise AssertionError(f"tandem rejects {list(command)}: exit {exc.code}") from exc


def _same_value(parsed: Any, text: str) -> bool:
    if isinstance(parsed, bool):
        return parsed == (text.lower() in {"1", "true", "yes", "on"})
    if isinstance(parsed, int | float):
        try:
            return float(parsed) == float(text)
        except ValueError:
            return False
    return str(parsed) == text


def env_flag_problems(command: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Each TANDEM_* variable must feed a flag of the command's subcommand
    (``TANDEM_DRAIN_TIMEOUT`` -> ``--drain-timeout``) and reach it with its value: a
    misspelt or unknown variable would be silently ignored by the service."""
    parser = subparsers()[command[1]]
    args = parse_command(command, env)
    problems = []
    for name, value in sorted(env.items()):
        if not name.startswith("TANDEM_"):
            continue
        flag = ENV_FLAG_ALIASES.get(name, "--" + name.removeprefix("TANDEM_").lower().replace("_", "-"))
        action = parser._option_string_actions.get(flag)
        if action is None:
            problems.append(f"{name}: `tandem {command[1]}` has no {flag}")
        elif flag not in command and name not in ENV_FLAG_ALIASES:
            parsed = getattr(args, action.dest)
            if not _same_value(parsed, value):
                problems.append(f"{name}={value!r} does not reach {flag} (parsed {parsed!r})")
    return problems
