"""The stages' measures of readability hold, and every figure the README states about the code
is the code's."""

import argparse
import ast
import io
import itertools
import re
import runpy
import subprocess
import sys
import tokenize

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import EPOCH_LINE, REPO, STAGES, single_gpu

README = (REPO / "README.md").read_text()
# Changed lines to the next stage, and code tokens (Python's tokens outside comments, docstrings
# and argparse's help strings): no stage grows past these figures. Comments and help are free.
LIMITS = {"single_gpu": 136, "multigpu": 43, "multigpu_torchrun": 25, "multinode": 117}
TOKENS = {"single_gpu": 3_564, "multigpu": 4_396, "multigpu_torchrun": 4_266, "multinode": 4_443}
TOKENS["fsdp"] = 5_256


def changed_lines(a: str, b: str) -> int:
    diff = subprocess.run(["diff", REPO / f"{a}.py", REPO / f"{b}.py"], capture_output=True)
    return sum(line[:1] in (b"<", b">") for line in diff.stdout.splitlines())


def end_of_line_comments(source: str) -> float:
    """The share of code lines (not blank, not only a comment or a string) that end in a comment."""
    code, commented = set(), set()
    skipped = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.STRING)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            commented.add(token.start[0])
        elif token.type not in (*skipped, tokenize.ENDMARKER):
            code.add(token.start[0])
    return len(code & commented) / len(code)


def code_tokens(source: str) -> int:
    """Python's tokens outside comments, docstrings and argparse's help strings: the code a
    reader must follow."""
    tree = ast.parse(source)
    docstrings = {
        node.body[0].lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef)
        and ast.get_docstring(node, clean=False) is not None
    }
    layout = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    count, last = 0, []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (*layout, tokenize.COMMENT):
            continue
        prose = token.type == tokenize.STRING and (
            token.start[0] in docstrings or last[-2:] == ["help", "="]
        )
        count += not prose
        last = [*last[-1:], token.string]
    return count


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_reads_as_plain_lines(stage):
    """End-of-line comments on at most 15% of code lines, no line over 100 columns, and the code
    within its tokens (TOKENS). No line counts: a reader found text packed to fit them."""
    source = (REPO / f"{stage}.py").read_text()
    assert end_of_line_comments(source) <= 0.15
    assert max(len(line) for line in source.splitlines()) <= 100
    assert code_tokens(source) <= TOKENS[stage], code_tokens(source)


def test_help_strings_are_prose_not_code():
    """A help string costs no code token; the `, help=` before it does."""
    with_help = 'parser.add_argument("--lr", type=float, help="a long sentence, many words")\n'
    without = 'parser.add_argument("--lr", type=float)\n'
    assert code_tokens(with_help) == code_tokens(without) + 3


@pytest.mark.parametrize("stage", STAGES)
def test_help_gives_the_launch_command_and_every_flag_with_its_default(stage, capsys):
    """--help: the docstring as written (its launch command intact on its lines), then a line of
    help for every flag, with its default where it has one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [f"{stage}.py", "--help"])
        patch.setattr("atexit.register", lambda function, *args: function)
        with pytest.raises(SystemExit):
            runpy.run_path(str(REPO / f"{stage}.py"), run_name="__main__")
    shown = capsys.readouterr().out
    doc = ast.get_docstring(ast.parse((REPO / f"{stage}.py").read_text()), clean=False)
    command = next(line for line in doc.splitlines() if line.startswith("    "))
    assert command in shown.splitlines(), shown
    entries = re.split(r"\n(?=  -)", shown.split("\noptions:\n")[1])  # one a flag, help after it
    shown_flags = {f: d for f, d in stage_flags(stage).items() if f != "--local_rank"}  # hidden
    for flag, default in shown_flags.items():
        (entry,) = [" ".join(e.split()) for e in entries if e.lstrip().startswith(f"{flag} ")]
        if default not in (None, False) and flag != "--world_size":
            assert entry.endswith(f"(default: {default})"), entry
        assert len(entry.split()) > 3, entry  # the flag, its value's name, and a help text


def test_the_diffs_stay_small_and_the_readme_states_them():
    for a, b in itertools.pairwise(STAGES):
        changed = changed_lines(a, b)
        assert changed <= LIMITS[a], (a, b, changed)
        stated = re.search(rf"^diff {a}\.py {b}\.py +# (\d+)", README, re.M)
        assert stated and int(stated[1]) == changed, (a, b)


def test_the_readme_is_short():
    assert len(README) <= 12_000


def test_the_readmes_commands_run_in_order_in_one_folder(runs):
    """First run, then each stage as the README launches it (fewer epochs), where the command
    before it ran: every one ends well (its own snapshot path), and the first trains 3 epochs;
    the second, `2 1` on the first's snapshot, says that it resumed and has nothing to train."""
    done = runs["readme"]
    assert done[0][0] == "python single_gpu.py 3 3" and len(done) >= 4, [c for c, _ in done]
    for command, run in done:
        assert run.returncode == 0 and "Traceback" not in run.output, (command, run.output)
    assert done[1][0] == "python single_gpu.py 2 1", done[1][0]
    assert done[1][1].output == "single_gpu.pt: resumed after epoch 3, 0 to go\n"
    ran = dict(done)
    multigpu = ran["python multigpu.py 2 1"]  # --world_size by default: 2 processes on the CPU
    assert [(e[0], e[4]) for e in multigpu.epochs()] == [(1, 64), (2, 64)], multigpu.output


def test_the_first_run_prints_what_the_readme_shows(runs):
    """Epochs, learning rates and global batch exactly; loss and accuracy to what another torch
    or CPU may change."""
    shown = EPOCH_LINE.findall(README.split("python single_gpu.py 3 3\n```", 1)[1])
    printed = runs["readme"][0][1].epochs()
    assert [int(line[0]) for line in shown] == [e[0] for e in printed] == [1, 2, 3]
    for line, (_, loss, acc, lr, batch, _) in zip(shown, printed, strict=True):
        assert (float(line[3]), int(line[4])) == (lr, batch)
        assert float(line[1]) == pytest.approx(loss, rel=0.1, abs=0.002)
        assert float(line[2]) == pytest.approx(acc, abs=0.05)


def stage_flags(stage: str) -> dict:
    """{--flag: default} of the stage's own parser, as its __main__ block builds it."""
    built = {}

    def keep(parser, *args, **kwargs):
        built["parser"] = parser
        raise KeyboardInterrupt  # out of the script, before it trains

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", keep)
        patch.setattr(sys, "argv", [f"{stage}.py"])
        patch.setattr("atexit.register", lambda function, *args: function)  # not in pytest's
        with pytest.raises(KeyboardInterrupt):
            runpy.run_path(str(REPO / f"{stage}.py"), run_name="__main__")
    defaults = vars(argparse.ArgumentParser.parse_args(built["parser"], []))
    return {
        f"--{name}": value for name, value in defaults.items() if name not in ("epochs", "every")
    }


def test_the_flags_table_states_every_flag_and_its_default():
    """Every row of the table is a flag of every stage with the default it states, and every
    flag is in the table, but those the README gives beside the launch lines."""
    rows = {
        flag: stated.strip()
        for flag, stated in re.findall(r"^\| `(--\w+)` \| ([^|]+) \|", README, re.M)
    }
    flags = stage_flags("single_gpu")
    assert rows.keys() == flags.keys() - {"--total_epochs", "--save_every"}, rows.keys()
    assert "`--total_epochs 50 --save_every 10`" in README
    special = {
        "--snapshot_path": "STAGE.pt",
        "--data_dir": "built-in",
        "--workers": "GPU: 8, CPU: 0",
    }
    assert flags["--snapshot_path"] == "single_gpu.pt" and flags["--data_dir"] is None
    for flag, default in flags.items():
        if flag in rows:
            if isinstance(default, float):
                assert float(rows[flag]) == default, flag
            else:
                shown = "off" if default is False else special.get(flag, str(default))
                assert rows[flag] == shown, (flag, rows[flag], default)
    extra = {"multigpu": {"--world_size"}, "multigpu_torchrun": {"--local_rank"}}
    extra["multinode"] = extra["fsdp"] = extra["multigpu_torchrun"]
    for stage, more in extra.items():
        other = stage_flags(stage)
        assert other.keys() == flags.keys() | more, stage
        assert {f: v for f, v in other.items() if f in flags and f != "--snapshot_path"} == {
            f: v for f, v in flags.items() if f != "--snapshot_path"
        }, stage
        assert other["--snapshot_path"] == f"{stage}.pt"
    assert "--world_size N (default: every GPU; CPU: 2)" in README


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 8 on this machine's 2 cores
@pytest.mark.parametrize("gpu, threads, workers", [(True, 16, 8), (True, 2, 2), (False, 16, 0)])
def test_the_loader_workers_by_default(monkeypatch, gpu, threads, workers):
    """As the flags table says: 8 a process on GPUs, at most its share of the cores (setup() sets
    its threads to it), and none on the CPU."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    args = argparse.Namespace(workers=None, batch_size=2, seed=0)
    data = TensorDataset(torch.zeros(4, 1), torch.zeros(4))
    train_data, val_data = single_gpu().prepare_dataloaders(data, data, args, gpu)
    assert train_data.num_workers == val_data.num_workers == workers


def test_the_other_figures_the_readme_states():
    train, val, classes = single_gpu().load_datasets(None, 32, "none")
    assert (len(train) + len(val), len(train), len(val), classes) == (720, 640, 80, 10)
    assert train[0][0].shape == (3, 32, 32)
    assert "720 noisy 3x32x32 images of 10 classes (640 to train, 80 held out)" in README
    assert "`epoch N: step S of T`\nevery 30 s inside longer epochs" in README  # test_stages.py
    batch_files = {path.name: path.read_text() for path in (REPO / "slurm").glob("*.sh")}
    for name, text in batch_files.items():
        assert "#SBATCH --signal=B:USR1@120" in text, name  # "two minutes before"
        assert 'set -- --total_epochs 50 --save_every 10 "$@"' in text, name
        assert "${MAX_REQUEUES:-20}" in text, name
        if re.search(r"^srun .*torchrun", text, re.M):
            assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}" in text and "--max-restarts" not in text
    multinode = batch_files["multinode.sh"]
    assert "#SBATCH --nodes=2" in multinode and "#SBATCH --gpus-per-node=4" in multinode
    assert "`MAX_REQUEUES` (20)" in README and "(100 s;" in README and "2 nodes x 4 GPUs" in README


def diff_hunks(text: str) -> list[str]:
    """The hunks of `diff` output, each with its header (`44a48,54`: where it stands today)."""
    return sorted(h for h in re.split(r"(?m)^(?=\d+(?:,\d+)?[acd]\d+(?:,\d+)?$)", text) if h)


def test_the_walkthrough_quotes_every_hunk_of_the_diffs():
    """WALKTHROUGH.md: under each diff's heading, its hunks as `diff` prints them, headers too, each
    once, and nothing else in a diff block but context: lines indented by two spaces, each a line
    of the newer file; the DDP core comes first. A hunk that changed, or a new one, fails this test
    until the walkthrough explains it."""
    walkthrough = (REPO / "WALKTHROUGH.md").read_text()
    sections = re.split(r"(?m)^## `diff (\w+)\.py (\w+)\.py`$", walkthrough)[1:]
    assert [tuple(sections[i : i + 2]) for i in range(0, len(sections), 3)] == list(
        itertools.pairwise(STAGES)
    )
    for a, b, text in zip(sections[0::3], sections[1::3], sections[2::3], strict=True):
        lines = "".join(re.findall(r"```diff\n(.*?)```", text, re.S)).splitlines(keepends=True)
        context = {line[2:] for line in lines if line.startswith("  ")}
        assert context <= set((REPO / f"{b}.py").read_text().splitlines(keepends=True)), (a, b)
        quoted = diff_hunks("".join(line for line in lines if not line.startswith("  ")))
        diff = subprocess.run(["diff", REPO / f"{a}.py", REPO / f"{b}.py"], capture_output=True)
        assert quoted == diff_hunks(diff.stdout.decode()), (a, b)
    assert walkthrough.index("Part 1: what makes DDP work") < walkthrough.index("Part 2")
    # A hunk that cannot be read alone carries its neighbours: the resume's first step.
    step = re.search(r"\n  .*\n<.*\n---\n>         first = math.ceil.*\n  .*\n", walkthrough)
    assert step and "sampler.start" in step[0], "the resume's step without its neighbours"
    assert "[WALKTHROUGH.md](WALKTHROUGH.md)" in README
