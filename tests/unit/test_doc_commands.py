"""Every documented command, as a newcomer copies it from a fresh checkout (issue 46).

The commands are read from README.md and docs/*.md — each line of a ```bash block and each inline
`code` span that starts with a command (torchrun, python, make, launch/, sbatch, hf, ...) — so a new
doc's commands are covered without a change here. What each gets:

- a training launch (``torchrun ... train_grpo.py``, ``python -m miles.launch``, ``python
  train_grpo.py``, ``launch/*.sh``, ``sbatch launch/slurm.sbatch``): its flags through
  ``train_grpo.main`` in this process as a dry run at the launch's world size (nproc x nodes).
  A GPU recipe's model folder, when it is not on this machine, is replaced by the config-only
  folder of the same model (``miles.models.config_folders``); a refusal then passes only when
  everything it names is an input the docs tell the user to supply (under /models, /data, /ckpt).
  The tiny I2V try-it runs for every I2V variant;
- ``python -m MODULE`` / ``python bench/X.py``: the module or script exists and defines every
  ``--flag`` the command gives (``miles.eval``: parsed by its own parser);
- ``make TARGET``: the Makefile has the target; other files named (``launch/...``, test paths): exist;
- ``hf``: the venv has it (``huggingface-cli`` is not installed by the pinned huggingface_hub).

Commands with placeholders (``...``, ``…``, ``$VAR``, ``NPROC``, ``OUT``) are templates and only
parsed as far as their words go; the lines of a block that are output samples are skipped.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("torchrun", "python", "make", "launch/", "sbatch", "hf", "huggingface-cli", "bash")
SKIPPED = ("wandb", "vllm", "source", "export", "for", "done", "curl", "sha256sum", "pytest")
EXTERNAL = ("/models/", "/data/", "/ckpt/")  # inputs the docs tell the user to supply
# config-only folders (miles.models.config_folders) for the GPU recipes' models
CONFIG_FOLDERS = {
    "Wan2.1-T2V-1.3B": "wan2.1-t2v-1.3b",
    "Wan2.1-T2V-14B": "wan2.1-t2v-14b",
    "Wan2.2-T2V-A14B": "wan2.2-t2v-a14b",
    "Wan2.2-TI2V-5B": "wan2.2-ti2v-5b",
}
I2V_VARIANTS = ("i2v", "i2v_two_expert", "ti2v")


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    words: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    error: str = ""  # the documented refusal printed under it ("error: ..."), if any
    inline: bool = False  # named in a sentence (a reference, maybe partial), not a block's command line

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


def _parse(where: str, line: str) -> Command | None:
    line = line.split(" # ")[0].strip().removeprefix("$ ")
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    env = []
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        env.append(tuple(words.pop(0).split("=", 1)))  # environment assignments
    if words and words[0].startswith(".venv/bin/"):
        words[0] = words[0].removeprefix(".venv/bin/")
    if not words or not words[0].startswith(PROGRAMS):
        return None
    return Command(where, tuple(words), tuple(env))


def _blocks(text: str):
    """(first line number, lines) of each fenced block of shell (```bash, ```sh, ```console, ```)."""
    lang, first, body = None, 0, []
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if lang is None:
                lang, first, body = line.strip()[3:], n + 1, []
            else:
                if lang in ("bash", "sh", "console", ""):
                    yield first, body
                lang = None
        elif lang is not None:
            body.append(line)


def doc_commands() -> list[Command]:
    found: list[Command] = []
    for doc in DOCS:
        text = doc.read_text()
        rel = doc.relative_to(REPO)
        for first, lines in _blocks(text):
            joined, start = "", 0
            for i, line in enumerate(lines):
                start = start if joined else i
                if line.rstrip().endswith("\\"):
                    joined += line.rstrip()[:-1] + " "
                    continue
                cmd = _parse(f"{rel}:{first + start}", joined + line)
                joined = ""
                if cmd is not None:
                    after = lines[i + 1].strip() if i + 1 < len(lines) else ""
                    if after.startswith("error: "):
                        cmd = dataclasses.replace(cmd, error=after.removeprefix("error: "))
                    found.append(cmd)
        prose = re.sub(r"^\s*```.*?^\s*```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for span in re.finditer(r"`([^`]+)`", prose):
            cmd = _parse(
                f"{rel}:{prose[: span.start()].count(chr(10)) + 1}", span.group(1).replace("\n", " ")
            )
            if cmd is not None and len(cmd.words) > 1:
                found.append(dataclasses.replace(cmd, inline=True))
    return found


COMMANDS = doc_commands()


def _template(words) -> bool:
    return any(
        w in ("...", "…")
        or "$" in w
        or w in ("NPROC", "OUT", "DIR", "N")
        or w.startswith("[")
        or w.endswith("]")
        for w in words
    )


def _without_optional(words) -> list[str]:
    """The words less the optional ones shown in brackets (``[--flag]``, ``[--a 2 --b 2]``)."""
    out, depth = [], 0
    for w in words:
        depth += w.startswith("[")
        if not depth:
            out.append(w)
        depth -= w.endswith("]")
    return out


def _flags(words) -> list[str]:
    words = list(words)
    if "--" in words:
        words = words[: words.index("--")]
    return [w.split("=")[0] for w in words if w.startswith("--")]


def _train_launch(cmd: Command) -> tuple[list[str], int] | None:
    """The training flags of a launch and its world size (None: not a training launch)."""
    w = list(cmd.words)
    env = dict(cmd.env)
    if w[0] in ("torchrun", "python") and any(x.endswith("train_grpo.py") for x in w):
        at = next(i for i, x in enumerate(w) if x.endswith("train_grpo.py"))
        launcher = w[:at]
        nproc = _opt(launcher, "--nproc-per-node", "1")
        nodes = _opt(launcher, "--nnodes", "1")
        nodes = nodes.split(":")[-1]
        return w[at + 1 :], int(nproc) * int(nodes) if (nproc + nodes).isdigit() else 8
    if w[0] == "launch/single_node.sh":
        rest = w[1:]
        nproc = int(rest.pop(0)) if rest and rest[0].isdigit() else int(env.get("NPROC", 4))
        return rest, nproc
    if w[0] == "launch/multi_node.sh":
        return w[1:], int(env.get("NNODES", 1)) * int(env.get("NPROC_PER_NODE", 8))
    if w[0] == "sbatch" and "launch/slurm.sbatch" in w:
        at = w.index("launch/slurm.sbatch")
        return w[at + 1 :], 8 * int(_opt(w[:at], "--nodes", "1"))
    return None


def _opt(words, name, default):
    for i, x in enumerate(words):
        if x == name and i + 1 < len(words):
            return words[i + 1]
        if x.startswith(name + "="):
            return x.split("=", 1)[1]
    return default


@pytest.fixture(scope="module")
def config_folders(tmp_path_factory):
    """Config-only folders of the published models, each written when first asked for."""
    from miles.models.config_folders import write_config_folder

    root = tmp_path_factory.mktemp("wan-configs")

    class Lazy(dict):
        def __missing__(self, name):
            self[name] = write_config_folder(name, root / name)
            return self[name]

    return Lazy()


@pytest.fixture(scope="module")
def world_i2v():
    """``make world-i2v-model`` (a folder of symlinks), which the I2V world's commands follow."""
    from miles.world.i2v import build_i2v_world

    if not (REPO / ".cache/world-i2v/model_index.json").is_file():
        build_i2v_world(REPO / ".cache/world-i2v")


@pytest.fixture(scope="module")
def reward_server():
    """The reward server a block starts in its other shell (``python -m miles.rewards.serve
    --rewards world_adherence``), on its threading engine and a free port: its URL."""
    import threading

    from miles.rewards.registry import build_rewards
    from miles.rewards.serve import RewardService, make_server

    server = make_server(RewardService(build_rewards({"world_adherence": 1.0}).rewards))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


_RAN: dict[tuple, tuple[int, str]] = {}  # one dry run per distinct launch (several docs repeat one)


def _dry_run(flags: list[str], world: int, capsys) -> tuple[int, str]:
    import train_grpo

    key = (tuple(flags), world)
    if key not in _RAN:
        code = train_grpo.main([*flags, "--dry-run", "--world-size", str(world)])
        out = capsys.readouterr()
        _RAN[key] = code, out.out + out.err
    return _RAN[key]


def _substitute_model(flags: list[str], config_folders) -> list[str]:
    from miles.config import parse_args

    cfg, _ = parse_args(flags)
    path = cfg.model.path
    if path is None or Path(path).exists():
        return flags
    for key, name in CONFIG_FOLDERS.items():
        if key in path or Path(path).name == name:  # a published model, or the README's config folder
            if "--model.path" in flags:
                at = flags.index("--model.path") + 1
                return [*flags[:at], str(config_folders[name]), *flags[at + 1 :]]
            return [*flags, "--model.path", str(config_folders[name])]
    return flags


def _only_external(message: str) -> bool:
    """Whether every input a dry-run refusal names is one the user supplies (under /models, ...)."""
    body = message.split("error:", 1)[-1]
    items = [line for line in body.splitlines() if line.strip().startswith("- ")] or [body]
    return all(any(e in item for e in EXTERNAL) for item in items)


TRAIN = [c for c in COMMANDS if _train_launch(c) is not None]


def test_the_docs_have_commands_of_each_kind():
    """The extraction finds the documented launches (a guard against it silently finding nothing)."""
    text = "\n".join(map(str, TRAIN))
    assert "configs/tiny_i2v_cpu.yaml" in text and "--model.tiny-variant ti2v" in text, text
    assert "launch/single_node.sh" in text and "configs/wan2_1_t2v_1_3b.yaml" in text, text
    assert len(TRAIN) >= 8 and len(COMMANDS) >= 40, len(COMMANDS)


@pytest.mark.parametrize("cmd", TRAIN, ids=str)
def test_documented_training_launch_dry_runs(cmd, capsys, monkeypatch, request, config_folders, world_i2v):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NPROC_PER_NODE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    flags, world = _train_launch(cmd)
    flags = _without_optional(flags)
    config = _opt(flags, "--config", "configs/")
    if _template(flags) or not (REPO / config).exists():
        pytest.skip("a template (placeholders, or a config of the user's own)")
    if "--help" in flags:
        if "--help" not in _RAN:
            from miles.config import parse_args

            with pytest.raises(SystemExit) as e:
                parse_args(["--help"])
            _RAN["--help"] = e.value.code, capsys.readouterr().out
        code, out = _RAN["--help"]
        assert code == 0 and "--train.num-rollouts" in out
        return
    flags = [f for f in flags if f not in ("--dry-run",)]
    if "--world-size" in flags:  # a documented dry run names its world size
        at = flags.index("--world-size")
        world = int(flags[at + 1])
        del flags[at : at + 2]
    flags = _substitute_model(flags, config_folders)
    if "remote" in config:  # the block's other shell runs the reward server: here, on a free port
        flags = [*flags, "--reward.remote.url", request.getfixturevalue("reward_server")]
    variants = [flags]
    if _opt(flags, "--model.tiny-variant", None) in I2V_VARIANTS:  # the I2V try-it: every variant
        at = flags.index("--model.tiny-variant") + 1
        variants = [[*flags[:at], v, *flags[at + 1 :]] for v in I2V_VARIANTS]
    for argv in variants:
        code, out = _dry_run(argv, world, capsys)
        if cmd.error:  # a documented refusal: refused so, with the message shown
            assert code == 2 and cmd.error in " ".join(out.split()), (
                f"{cmd}: documented error not printed\n{out}"
            )
            continue
        if code == 2 and _only_external(out):
            continue  # refuses only the recipe's inputs this machine lacks, as the docs say it will
        assert code == 0, (
            f"{cmd}\n  ran as: train_grpo.py {shlex.join(argv)} --dry-run --world-size {world}\n{out}"
        )


OTHER = [c for c in COMMANDS if _train_launch(c) is None and c.words[0] not in SKIPPED]


@pytest.mark.parametrize("cmd", OTHER, ids=str)
def test_documented_command_parses(cmd):
    w = list(cmd.words)
    if w[0] == "make":
        makefile = (REPO / "Makefile").read_text()
        targets = re.findall(r"^([\w-]+):", makefile, re.M)
        variables = re.findall(r"^(\w+)\s*[?:]?=", makefile, re.M)
        for word in w[1:]:
            if "=" in word:  # a variable given on make's command line: one the Makefile reads
                assert word.split("=", 1)[0] in variables, f"{cmd}: the Makefile has no variable {word!r}"
            else:
                assert word in targets, f"{cmd}: no make target {word!r}"
        return
    if w[0] == "huggingface-cli":
        pytest.fail(
            f"{cmd}: huggingface-cli is not installed by the pinned huggingface_hub; use `hf download`"
        )
    if w[0] == "hf":
        import shutil
        import sys

        hf = Path(sys.executable).parent / "hf"
        hf = str(hf) if hf.exists() else shutil.which("hf")
        assert hf, f"{cmd}: no hf"
        import subprocess

        usage = subprocess.run([hf, *w[1:2], "--help"], capture_output=True, text=True, timeout=60).stdout
        assert all(flag in usage for flag in _flags(w)), f"{cmd}: hf does not take {_flags(w)}\n{usage}"
        return
    if w[0] == "python" and len(w) > 2 and w[1] == "-m":
        module = w[2]
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, f"{cmd}: no module {module}"
        if module == "miles.eval" and not cmd.inline:
            from miles.eval.__main__ import _options

            opts, _ = _options().parse_known_args(w[3:])
            assert opts.out is not None
            return
        _check_flags(cmd, w[3:], Path(spec.origin))
        return
    if w[0] == "python":
        script = REPO / w[1]
        assert script.is_file(), f"{cmd}: no file {w[1]}"
        _check_flags(cmd, w[2:], script)
        return
    for word in w:  # launch/..., bash x.sh, test paths
        if "/" in word and not word.startswith("-") and not _template([word]):
            assert list(REPO.glob(word)), f"{cmd}: {word} does not exist"


def _check_flags(cmd: Command, args: list[str], source: Path) -> None:
    files = [source]
    if source.name == "__main__.py" or source.name == "__init__.py":
        files += list(source.parent.glob("*.py"))
    text = "\n".join(f.read_text() for f in files)
    for flag in _flags(args):
        assert f'"{flag}"' in text or f"'{flag}'" in text, f"{cmd}: {source.name} has no option {flag}"
