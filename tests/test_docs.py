"""Every code block of the user guide (docs/guide/*.md) runs and checks what the prose says.

A page's blocks run in document order in one fresh Python process (``_run_page`` below is its
program), so later blocks see the names of earlier ones and nothing leaks into this process:

- ```python blocks are exec'd in one namespace per page, compiled with the page as file name and
  their page line numbers, so a traceback points at the line of the Markdown file;
- a block preceded by ``<!-- run: torchrun 2 -->`` is a complete script run on 2 gloo ranks with
  ``python -m torch.distributed.run --nproc-per-node=2`` on 127.0.0.1;
- a ```bash block preceded by ``<!-- run: bash -->`` runs under ``bash -euo pipefail`` with
  ``$TMP`` (a per-page temporary directory, also the working directory) and the venv's bin first
  on ``PATH``; other bash blocks are shown, not run;
- ``<!-- skip -->`` before a fence: not run (code that cannot run here);
- ``<!-- requires: MODULE -->`` anywhere on a page: the page is skipped when MODULE is missing.

A failure names the page, the block's line and the kind, and shows the tail of the output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"
INDEX = GUIDE / "README.md"
PAGES = sorted(p for p in GUIDE.glob("*.md") if p != INDEX)
PAGE_TIMEOUT_S = 240

pytestmark = pytest.mark.e2e

MARKER = re.compile(r"^\s*<!--\s*(skip|run:\s*torchrun\s+2|run:\s*bash)\s*-->\s*$")
REQUIRES = re.compile(r"<!--\s*requires:\s*([A-Za-z_][\w.]*)\s*-->")
FENCE_OPEN = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    lang: str
    marker: str | None  # "skip", "torchrun", "bash" or None
    line: int  # 1-based line of the opening fence
    code: str

    @property
    def kind(self) -> str | None:
        """How the block runs: "python", "torchrun", "bash", or None (shown only)."""
        if self.marker == "skip":
            return None
        if self.marker == "torchrun":
            return "torchrun"
        if self.marker == "bash":
            return "bash"
        return "python" if self.lang == "python" else None


def parse_blocks(path: Path) -> list[Block]:
    """Fenced blocks of a Markdown page with the marker on the line before each fence."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE_OPEN.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{start + 1}: unclosed code fence")
        marker = None
        if start > 0 and (mm := MARKER.match(lines[start - 1])):
            word = mm.group(1)
            marker = "skip" if word == "skip" else ("torchrun" if "torchrun" in word else "bash")
        elif start > 0 and "<!--" in lines[start - 1] and not REQUIRES.search(lines[start - 1]):
            raise AssertionError(f"{path.name}:{start}: unknown marker {lines[start - 1].strip()!r}")
        blocks.append(Block(lang=m.group(1), marker=marker, line=start + 1, code="\n".join(lines[start + 1 : j]) + "\n"))
        i = j + 1
    for b in blocks:
        if b.marker == "bash" and b.lang != "bash":
            raise AssertionError(f"{path.name}:{b.line}: <!-- run: bash --> before a ```{b.lang} block")
        if b.marker == "torchrun" and b.lang != "python":
            raise AssertionError(f"{path.name}:{b.line}: <!-- run: torchrun 2 --> before a ```{b.lang} block")
    return blocks


# The program that runs one page: argv[1] is a JSON file with the page path and its blocks.
_RUNNER = textwrap.dedent(
    r'''
    import json, os, socket, subprocess, sys, time, traceback

    spec = json.load(open(sys.argv[1]))
    page, status, source = spec["page"], spec["status"], spec["source"]
    namespace = {"__name__": "__main__"}

    def report(line, kind, ok):
        with open(status, "w") as f:
            json.dump({"line": line, "kind": kind, "ok": ok}, f)

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    for block in spec["blocks"]:
        line, kind, code = block["line"], block["kind"], block["code"]
        report(line, kind, False)
        print(f"----- {page}:{line} ({kind})", flush=True)
        t0 = time.perf_counter()
        padded = "\n" * line + code  # the code's first line is the line after the fence
        if kind == "python":
            try:
                exec(compile(padded, source, "exec"), namespace)
            except BaseException:
                traceback.print_exc()
                sys.stdout.flush()
                sys.exit(1)
        else:
            if kind == "torchrun":
                script = os.path.join(os.getcwd(), f"{os.path.basename(page)[:-3]}_L{line}.py")
                with open(script, "w") as f:
                    # each rank leaves a mark once the whole block has run (see below)
                    f.write(padded + f"\nopen({script!r} + '.done.' + __import__('os').environ['RANK'], 'w').close()\n")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                       "--master-addr=127.0.0.1", f"--master-port={free_port()}", script]
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
            else:
                cmd = ["bash", "-euo", "pipefail", "-c", code]
                env = os.environ
            sys.stdout.flush()
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            print(done.stdout, end="", flush=True)
            if done.returncode != 0:
                # gloo sometimes aborts a process at interpreter exit ("terminate called without an
                # active exception") after the block ran to its end on every rank: not a failure
                # of the documented code (spawn_ranks in tests/helpers.py treats it the same way)
                finished = kind == "torchrun" and all(os.path.exists(f"{script}.done.{r}") for r in range(2))
                if finished and "terminate called without an active exception" in done.stdout:
                    print("warning: every rank finished the block, then one aborted at exit", flush=True)
                else:
                    print(f"exit status {done.returncode}", flush=True)
                    sys.exit(1)
        report(line, kind, True)
        print(f"----- {page}:{line} done in {time.perf_counter() - t0:.1f} s", flush=True)
    '''
)


def _page_id(path: Path) -> str:
    return path.name


def test_guide_exists() -> None:
    assert INDEX.is_file(), f"{INDEX} is missing"
    assert PAGES, f"no pages in {GUIDE}"


def test_index_links_every_page() -> None:
    text = INDEX.read_text()
    links = set(re.findall(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)", text))
    missing = [p.name for p in PAGES if p.name not in links]
    assert not missing, f"{INDEX.name} does not link {missing}"
    dangling = sorted(link for link in links if "/" not in link and not (GUIDE / link).is_file())
    assert not dangling, f"{INDEX.name} links pages that do not exist: {dangling}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_page_runs(page: Path, tmp_path: Path) -> None:
    blocks = parse_blocks(page)
    runnable = [b for b in blocks if b.kind is not None]
    assert runnable, f"{page.name}: no executed block (every guide page needs a runnable example)"
    for module in REQUIRES.findall(page.read_text()):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{page.name} needs {module!r}, which is not importable here")

    work = tmp_path / "work"
    work.mkdir()
    rel = str(page.relative_to(ROOT))
    status = tmp_path / "status.json"
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps({
        "page": rel, "source": str(page), "status": str(status),
        "blocks": [{"line": b.line, "kind": b.kind, "code": b.code} for b in runnable],
    }))
    runner = tmp_path / "run_page.py"
    runner.write_text(_RUNNER)
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        # one thread: the snippets are tiny, and on a shared 2-core machine two OpenMP threads per
        # process spin against the other processes' threads (10-100x slower steps, measured)
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TMP": str(work),
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "Agg",
    }
    try:
        done = subprocess.run(
            [sys.executable, str(runner), str(spec)], cwd=work, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=PAGE_TIMEOUT_S,
        )
        output, failed = done.stdout, done.returncode != 0
    except subprocess.TimeoutExpired as err:
        out = err.stdout or b""
        output = (out.decode(errors="replace") if isinstance(out, bytes) else out) + f"\n[timed out after {PAGE_TIMEOUT_S} s]"
        failed = True
    if failed:
        where = json.loads(status.read_text()) if status.exists() else {"line": "?", "kind": "?"}
        tail = output[-6000:]
        pytest.fail(f"{rel}: the {where['kind']} block at line {where['line']} failed; output tail:\n{tail}", pytrace=False)


def test_runner_tolerates_only_an_abort_after_every_rank_finished(tmp_path: Path) -> None:
    """A torchrun block whose ranks all ran to the end and then one aborted at exit (gloo's
    teardown abort) passes; a rank that stops before the end fails the page, even with the same
    message in the output."""
    runner = tmp_path / "run_page.py"
    runner.write_text(_RUNNER)
    # rank 1 aborts at exit only once rank 0 has left its mark (or after 60 s): without the wait, a
    # loaded machine let rank 1 abort first and torchrun end rank 0 before its mark, which is the
    # other case (a rank that did not finish), and the first half failed
    abort_at_exit = textwrap.dedent('''
        import atexit, os, sys, time
        def _abort_once_rank_0_is_done(mark=__file__ + ".done.0"):
            deadline = time.monotonic() + 60
            while not os.path.exists(mark) and time.monotonic() < deadline:
                time.sleep(0.05)
            print("terminate called without an active exception", flush=True)
            os.abort()
        if os.environ["RANK"] == "1":
            atexit.register(_abort_once_rank_0_is_done)
        ''')
    stop_early = abort_at_exit + 'if os.environ["RANK"] == "1":\n    sys.exit(3)\n'
    codes = {}
    for name, code in (("abort_at_exit", abort_at_exit), ("stop_early", stop_early)):
        work = tmp_path / name
        work.mkdir()
        spec = work / "blocks.json"
        spec.write_text(json.dumps({"page": "docs/guide/fake.md", "source": str(work / "fake.md"),
                                    "status": str(work / "status.json"),
                                    "blocks": [{"line": 1, "kind": "torchrun", "code": code}]}))
        done = subprocess.run([sys.executable, str(runner), str(spec)], cwd=work, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        codes[name] = (done.returncode, done.stdout)
    assert codes["abort_at_exit"][0] == 0 and "aborted at exit" in codes["abort_at_exit"][1], codes["abort_at_exit"]
    assert codes["stop_early"][0] == 1 and "exit status" in codes["stop_early"][1], codes["stop_early"]
