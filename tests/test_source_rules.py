"""Rules of the package's source that keep it correct on GPUs, checked by reading the code.

A GPU user's first crashes came from code that runs fine on CPU and gloo: a collective called
with CPU tensors (NCCL takes only CUDA tensors) and tensors built without a device. On this
CPU-only machine no run can show those bugs, so the rules are checked in the source:

- every ``torch.distributed`` collective is called in ``moeflow/parallel/comm.py``, which puts
  tensors on the group's device (``comm.group_device``); ``torch.distributed`` is imported only
  under ``moeflow/parallel/``;
- in ``parallel/``, ``checkpoint/``, ``train/`` and ``models/``, every tensor constructor names
  its ``device=``; where the host is meant, ``device="cpu"`` says so (or a ``# device-ok:``
  comment on the call's line gives the reason).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import moeflow
from moeflow.parallel.comm import _accepted_device_types

pytestmark = pytest.mark.unit

PACKAGE = Path(moeflow.__file__).parent

# torch.distributed's collectives (and point-to-point calls), by name
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "all_gather_single", "all_gather_coalesced", "all_to_all", "all_to_all_single", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "barrier", "monitored_barrier",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list",
})
CONSTRUCTORS = frozenset({
    "tensor", "as_tensor", "zeros", "empty", "full", "ones", "arange", "randn", "rand", "randint", "randperm",
    "eye", "linspace",
})
DEVICE_PACKAGES = ("parallel", "checkpoint", "train", "models")


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(PACKAGE.parent) if PACKAGE in path.parents else path.name}:{line}"


def _sources(*packages: str) -> list[Path]:
    roots = [PACKAGE / p for p in packages] if packages else [PACKAGE]
    return sorted(f for root in roots for f in root.rglob("*.py"))


def _dist_names(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to the ``torch.distributed`` module and names imported from it."""
    modules, members = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            members.update(a.asname or a.name for a in node.names if a.name in COLLECTIVES)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
    return modules, members


def _is_torch_distributed(node: ast.expr, modules: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in modules
    return (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


def collective_calls(path: Path) -> list[str]:
    """``file:line: name`` of every torch.distributed collective called in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules, members = _dist_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES and _is_torch_distributed(f.value, modules):
            found.append(f"{_where(path, node.lineno)}: {f.attr}")
        elif isinstance(f, ast.Name) and f.id in members:
            found.append(f"{_where(path, node.lineno)}: {f.id}")
    return found


def constructors_without_device(path: Path) -> list[str]:
    """``file:line: torch.name`` of every tensor constructor in ``path`` that names no
    ``device=`` (and has no ``# device-ok:`` comment on its line)."""
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CONSTRUCTORS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
            continue
        if any(k.arg == "device" for k in node.keywords) or "# device-ok:" in lines[node.lineno - 1]:
            continue
        found.append(f"{_where(path, node.lineno)}: torch.{node.func.attr}")
    return found


def test_every_collective_is_called_in_comm_only():
    comm = PACKAGE / "parallel" / "comm.py"
    assert collective_calls(comm), "the checker finds nothing in comm.py: it is broken"
    outside = [hit for f in _sources() if f != comm for hit in collective_calls(f)]
    assert outside == [], "call these through moeflow.parallel.comm (it puts tensors on the group's device):\n" + \
        "\n".join(outside)


def test_torch_distributed_is_imported_under_parallel_only():
    hits = []
    for f in _sources():
        if (PACKAGE / "parallel") in f.parents:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            hits += [f"{f.relative_to(PACKAGE.parent)}:{node.lineno}: {n}" for n in names
                     if n == "torch.distributed" or n.startswith("torch.distributed.")]
    assert hits == [], "\n".join(hits)


def test_tensor_constructors_name_their_device():
    missing = [hit for f in _sources(*DEVICE_PACKAGES) for hit in constructors_without_device(f)]
    assert missing == [], "name device= (device=\"cpu\" where the host is meant):\n" + "\n".join(missing)


def test_the_checkers_see_what_they_look_for(tmp_path):
    """Each rule's checker, on a file that breaks it in every way it looks for (so a checker
    that finds nothing cannot pass the rules above by accident)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.distributed import all_reduce as ar\n"
        "import torch.distributed\n"
        "dist.all_gather(a, b)\nar(x)\ntorch.distributed.barrier()\ndist.get_rank()\n"
        "x = torch.zeros(3)\ny = torch.zeros(3, device='cpu')\nz = torch.arange(4)  # device-ok: test\n"
        "w = torch.tensor([1], dtype=torch.long)\n"
    )
    assert collective_calls(bad) == ["bad.py:5: all_gather", "bad.py:6: ar", "bad.py:7: barrier"]
    assert constructors_without_device(bad) == ["bad.py:9: torch.zeros", "bad.py:12: torch.tensor"]


@pytest.mark.parametrize("config, accepted", [
    ("cuda:nccl", {"cuda"}),
    ("cpu:gloo,cuda:gloo", {"cpu"}),
    ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
    ("cpu:gloo", {"cpu"}),
])
def test_the_devices_a_group_takes_follow_its_backends(config, accepted):
    assert _accepted_device_types(config) == accepted


def test_every_custom_op_name_is_defined_once():
    """Two ``torch.library.custom_op`` definitions under one name replace each other at import
    (which one a call reaches then depends on what was imported last: a fp32 grouped GEMM once
    ran the Triton op's fake implementation in one test process and not in another)."""
    pattern = re.compile(r"""custom_op\(\s*["'](moeflow::\w+)["']""")
    where: dict[str, list[str]] = {}
    for f in _sources():
        for m in pattern.finditer(f.read_text()):
            where.setdefault(m.group(1), []).append(_where(f, f.read_text().count("\n", 0, m.start()) + 1))
    assert len(where) >= 5, "the checker finds too few custom ops: it is broken"
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert twice == {}, twice
