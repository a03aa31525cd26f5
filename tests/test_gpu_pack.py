"""scripts/gpu_pack.py: what the GPU learning check carries, cut into device calls within the limit and put
back together there (the whole pack, with pip and the real packages, is scripts/gpu_dry_run.sh)."""

from __future__ import annotations

import importlib.util
import math
import os
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("gpu_pack", ROOT / "scripts" / "gpu_pack.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_pack = _load()


@pytest.mark.parametrize("capacity", [1, 7, 100, 250, 10_000])
def test_files_are_cut_into_the_fewest_parts_within_the_capacity(capacity: int) -> None:
    files = [("a", 120), ("b", 0), ("c", 333), ("d", 1)]
    parts = gpu_pack.split_into_parts(files, capacity)
    total = sum(size for _, size in files)
    assert len(parts) == max(1, math.ceil(total / capacity))
    assert all(sum(p["bytes"] for p in part) <= capacity for part in parts)
    for name, size in files:  # each file's pieces run on from one another and cover it
        pieces = [p for part in parts for p in part if p["file"] == name]
        assert pieces and pieces[0]["offset"] == 0
        assert all(x["offset"] + x["bytes"] == y["offset"] for x, y in zip(pieces, pieces[1:]))
        assert sum(p["bytes"] for p in pieces) == size


def _pack(tmp_path: Path, capacity: int) -> tuple[Path, dict[str, bytes], bytes]:
    """A site tree archived as the pack does, and a model file beside it, cut into parts."""
    site = tmp_path / "src-site"
    tree = {"pkg/__init__.py": b"VALUE = 1\n", "pkg/data.json": os.urandom(900), "pkg-1.0.dist-info/RECORD": b"x"}
    for rel, data in tree.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    archive = tmp_path / "site.tar.xz"
    with tarfile.open(archive, "w:xz", preset=0) as tar:
        for rel in sorted(tree):
            tar.add(site / rel, arcname=rel, recursive=False)
    model = os.urandom(2500)
    (tmp_path / "model.gguf").write_bytes(model)
    files = [
        {"name": "site.tar.xz", "kind": "site-archive", "path": archive},
        {"name": "weights/model.gguf", "kind": "site-file", "path": tmp_path / "model.gguf"},
    ]
    out = tmp_path / "carry"
    manifest = gpu_pack.write_parts(files, out, capacity)
    assert manifest["n_parts"] == len(list(out.iterdir())) >= 3
    assert all(gpu_pack.part_bytes(out / str(i)) <= capacity + 4096 for i in range(1, manifest["n_parts"] + 1))
    return out, tree, model


def test_the_parts_unpacked_in_any_order_install_the_tree_and_the_model(tmp_path: Path) -> None:
    out, tree, model = _pack(tmp_path, capacity=1200)
    n = len(list(out.iterdir()))
    order = [n, 1, *range(2, n)]
    work, site = tmp_path / "work", tmp_path / "site"
    for k, part in enumerate(order):
        missing = gpu_pack.unpack(out / str(part), work, site)
        assert missing == sorted(set(range(1, n + 1)) - set(order[: k + 1]))
    for rel, data in tree.items():
        assert (site / rel).read_bytes() == data
    assert (site / "weights/model.gguf").read_bytes() == model
    pieces = next(work.iterdir()) / "pieces"
    assert not any(pieces.iterdir())  # put together and installed: the pieces are gone


def test_a_corrupt_piece_is_named_and_nothing_is_installed_from_it(tmp_path: Path) -> None:
    out, _, _ = _pack(tmp_path, capacity=1200)
    n = len(list(out.iterdir()))
    last = out / str(n)
    piece = next(p for p in sorted(last.iterdir()) if p.name != gpu_pack.MANIFEST)
    data = bytearray(piece.read_bytes())
    data[0] ^= 0xFF
    piece.write_bytes(bytes(data))
    work, site = tmp_path / "work", tmp_path / "site"
    for part in range(1, n):
        gpu_pack.unpack(out / str(part), work, site)
    with pytest.raises(SystemExit, match="model.gguf put together from its pieces does not match its sha256"):
        gpu_pack.unpack(last, work, site)
    assert not (site / "weights/model.gguf").exists()


def test_a_part_of_another_pack_does_not_complete_this_one(tmp_path: Path) -> None:
    first, _, _ = _pack(tmp_path / "one", capacity=1200)
    second, _, _ = _pack(tmp_path / "two", capacity=1200)
    work, site = tmp_path / "work", tmp_path / "site"
    n = len(list(first.iterdir()))
    for part in range(1, n):
        gpu_pack.unpack(first / str(part), work, site)
    assert gpu_pack.unpack(second / str(n), work, site) == list(range(1, n))


def test_the_carried_packages_are_what_the_image_lacks() -> None:
    pytest.importorskip("packaging")
    carried = gpu_pack.carried_packages(gpu_pack.IMAGE_PYTHON)
    image = gpu_pack.image_packages()
    assert {"prefect", "litellm", "faiss-cpu", "pydantic", "gguf", gpu_pack.MODEL_PACKAGE} <= set(carried)
    assert not set(carried) & image
    assert not set(carried) & (set(gpu_pack.LEFT_OUT) | set(gpu_pack.NOT_ON_PATH))
    pins = gpu_pack.image_pins(gpu_pack.IMAGE_PYTHON)
    assert {"torch", "transformers", "pyarrow", "matplotlib"} <= set(pins) <= image


def test_a_need_the_images_listed_versions_do_not_meet_stops_the_pack() -> None:
    pytest.importorskip("packaging")
    carried = gpu_pack.carried_packages(gpu_pack.IMAGE_PYTHON)
    old = {**gpu_pack.image_versions(), "torch": "2.0.0", "typing-extensions": "3.7.4"}
    clashes = gpu_pack.image_conflicts(carried, gpu_pack.IMAGE_PYTHON, have=old)
    assert any(c.startswith("this project needs torch>=2.4") and c.endswith("the image has 2.0.0") for c in clashes)
    assert any("needs typing-extensions" in c for c in clashes)  # pydantic's, a carried package's
