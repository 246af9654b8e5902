"""Reading and writing artifact files safely: the folder an artifact may reach, regular files only, bounded reads,
and size checks of tensor files made from their headers / zip index before any tensor is loaded.

Artifacts come from Hub repos anyone can publish and from local clones full of symlinks. Everything here refuses
with :class:`ArtifactError` (a ``ValueError``) whose message names the file, the problem and the fix:

* a ``subfolder`` that leaves its repo (``"../x"``, absolute) - :func:`safe_subfolder`;
* a file that is not a regular file (a FIFO, ``/dev/zero``, a directory) or a symlink that resolves outside the
  artifact's folder (the Hub cache's ``snapshots/<rev>/<file> -> ../../blobs/<sha>`` links are inside its repo
  folder and keep working) - :func:`regular_file`;
* a ``config.json`` larger than :data:`MAX_CONFIG_BYTES`, nested deeper than :data:`MAX_JSON_DEPTH`, holding a
  number Python will not read (an integer of more than 4300 digits) or a string that is not Unicode text (a lone
  surrogate, which cannot be written back) - :func:`read_json`;
* a ``model.safetensors`` whose header is over :data:`MAX_SAFETENSORS_HEADER_BYTES`, declares tensors the config
  does not, other shapes, or byte ranges that do not tile the file exactly (a gap, an overlap, bytes past the last
  tensor, or more bytes than the file holds) - :func:`check_safetensors_header`;
* a RotationZoo ``.pt`` whose zip index declares a storage larger than a rotation, more bytes than the model's
  rotations (or, without the model's config, :data:`MAX_ZOO_BYTES`), or entries that inflate beyond the bytes they
  occupy (``torch.save`` stores tensors uncompressed) - :func:`check_zoo_archive`.

:func:`write_file` writes through a temporary file and ``os.replace``, so a symlink already in the target folder
(a cloned artifact repo) is replaced, never written through.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
import zipfile
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..settings import MAX_HEAD_DIM

MAX_CONFIG_BYTES = 8 << 20  # an artifact's config.json is a few kB; per-layer lists of large models stay far below
MAX_JSON_DEPTH = 32  # the format nests 4 deep (config -> layers -> entry -> layout)
MAX_SAFETENSORS_HEADER_BYTES = 16 << 20  # an artifact's header is one short entry per tensor: a few kB
# Sanity bounds on model shapes an artifact may declare (today's largest models: head_dim 256, 128 layers).
MAX_LAYERS = 4096
MAX_KV_HEADS = 4096
# What a RotationZoo import may read when the model's config does not bound it: float64 rotations and eigenvalues
# of 128 layers at head_dim 512, or 512 layers at head_dim 256 (today's models: head_dim <= 256, <= 128 layers).
MAX_ZOO_BYTES = 256 << 20
_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                         "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class ArtifactError(ValueError):
    """A calibration artifact that is malformed, hostile, or made for another model."""


# ---------------------------------------------------------------------------------------------- paths
def safe_subfolder(subfolder) -> str | None:
    """``subfolder`` as a relative POSIX path inside the repo, or None; refuses ones that leave it."""
    if subfolder is None or subfolder == "":
        return None
    if not isinstance(subfolder, (str, os.PathLike)):
        raise ArtifactError(f"subfolder must be a string (a folder inside the repo), got {type(subfolder).__name__}.")
    text = os.fspath(subfolder)
    posix, windows = PurePosixPath(text.replace("\\", "/")), PureWindowsPath(text)
    if posix.is_absolute() or windows.drive or windows.root or ".." in posix.parts or "\x00" in text:
        raise ArtifactError(f"subfolder={text!r} leaves the artifact's folder (absolute, a drive, or '..'). Pass a "
                            "folder inside the repo, e.g. subfolder='oscar', or pass the other folder itself as the "
                            "path to load.")
    parts = [p for p in posix.parts if p not in ("", ".")]
    return "/".join(parts) or None


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def hub_repo_folder(path: Path) -> Path | None:
    """The ``models--<org>--<name>`` folder of a file in the Hub cache (``.../snapshots/<rev>/...``), or None."""
    for parent in Path(path).absolute().parents:
        if parent.parent.name == "snapshots":
            return parent.parent.parent
    return None


def regular_file(path, root, where: str) -> Path:
    """``path`` if it is (or links to) a regular file inside ``root`` (or, for a file in the Hub cache, inside the
    cache's repo folder, where its blob lives); raises :class:`ArtifactError` otherwise. ``root=None``: a file
    ``hf_hub_download`` returned (its repo folder in the cache, else its own folder)."""
    path = Path(path)
    root = Path(root) if root is not None else (hub_repo_folder(path) or path.parent)
    try:
        target = path.resolve(strict=True)
        info = os.stat(target)
    except FileNotFoundError:
        raise OSError(f"{where}: {path} does not exist.") from None
    except (OSError, RuntimeError) as e:  # a symlink loop, a permission error
        raise ArtifactError(f"{where}: cannot resolve {path} ({e}); replace it with a regular file.") from e
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a FIFO" if stat.S_ISFIFO(info.st_mode) else \
            "a device or special file"
        raise ArtifactError(f"{where}: {path} is {kind}, not a regular file; refusing to read it. Replace it with "
                            "the artifact's file.")
    roots = [root.resolve()]
    repo = hub_repo_folder(path)
    if repo is not None:
        roots.append(repo.resolve())
    if not any(_inside(target, r) for r in roots):
        raise ArtifactError(f"{where}: {path} is a symlink to {target}, outside the artifact's folder {roots[0]}; "
                            "refusing to follow it. Replace the link with a copy of the file.")
    return path


def _read_bounded(path: Path, limit: int, where: str) -> bytes:
    # O_NONBLOCK: if the file was swapped for a FIFO since regular_file checked it, open() must not hang.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ArtifactError(f"{where}: {path} is not a regular file; refusing to read it.")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ArtifactError(f"{where}: {path.name} is larger than {limit} bytes, far more than an artifact's "
                            f"{path.name} holds; refusing to read it. Is this the right file?")
    return data


def _walk(value) -> tuple[int, str | None]:
    """Nesting depth of a JSON value, and the path of its first string (key or value) that is not Unicode text (a
    lone surrogate: JSON's ``\\udc80`` escape makes one, UTF-8 cannot hold it), or None."""
    deepest, bad, stack = 0, None, [(value, 1, "")]
    while stack:
        v, d, path = stack.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            for k, c in v.items():
                if bad is None and not _is_text(k):
                    bad = f"{path}.{k!a}" if path else f"{k!a}"
                stack.append((c, d + 1, f"{path}.{k}" if path else str(k)))
        elif isinstance(v, list):
            deepest = max(deepest, d)
            stack.extend((c, d + 1, f"{path}[{i}]") for i, c in enumerate(v))
        elif isinstance(v, str) and bad is None and not _is_text(v):
            bad = path or "the top level"
    return deepest, bad


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_json(path, where: str, limit: int = MAX_CONFIG_BYTES) -> object:
    """A JSON file read with a size cap and a nesting-depth cap; every string in it must be Unicode text."""
    path = Path(path)
    data = _read_bounded(path, limit, where)
    bad = None
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{where}: {path.name} is not valid JSON: {e}") from e
    except RecursionError:
        depth = MAX_JSON_DEPTH + 1
    except ValueError as e:  # json turns digits into int: over sys.get_int_max_str_digits() digits it refuses
        raise ArtifactError(f"{where}: {path.name} holds a number Python refuses to read ({e}); an artifact's "
                            "numbers are small. Is this the right file?") from None
    else:
        depth, bad = _walk(value)
    if depth > MAX_JSON_DEPTH:
        raise ArtifactError(f"{where}: {path.name} nests deeper than {MAX_JSON_DEPTH} levels; an artifact's config "
                            "nests 4. Is this the right file?")
    if bad is not None:
        raise ArtifactError(f"{where}: {path.name} key {bad} holds a string with a lone surrogate (a \\ud800-\\udfff "
                            "escape not part of a pair), which is not Unicode text and could not be saved again. "
                            "Fix the string in the file.")
    return value


# ---------------------------------------------------------------------------------------------- writing
def write_file(path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and ``os.replace``: an existing
    symlink at ``path`` is replaced by the file, never written through."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a saved artifact follows the umask like open() does
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------- tensor files
def check_safetensors_header(path, expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Check a safetensors file's header before loading: only the ``expected`` tensor names (name -> shape),
    floating point, each with the declared shape, and byte ranges inside the file."""
    path = Path(path)
    name = path.name
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ArtifactError(f"{where}: {name} is not a readable safetensors file (truncated to {size} bytes); "
                                "re-download or re-save the artifact.")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_SAFETENSORS_HEADER_BYTES:
            raise ArtifactError(f"{where}: {name} is not a readable safetensors file: it declares a {n}-byte "
                                f"header, more than the {MAX_SAFETENSORS_HEADER_BYTES} bytes hf_kvint2 reads (an "
                                "artifact's header is a few kB, one short entry per tensor). Is this the right file? "
                                "Re-download or re-save the artifact.")
        if n > size - 8:
            raise ArtifactError(f"{where}: {name} is not a readable safetensors file (it declares a {n}-byte header "
                                f"in a {size}-byte file: truncated?); re-download or re-save the artifact.")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, or an integer of more than 4300 digits
        raise ArtifactError(f"{where}: {name} is not a readable safetensors file (unreadable header: "
                            f"{type(e).__name__}); re-download or re-save the artifact.") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{where}: {name} is not a readable safetensors file (malformed header); re-download or "
                            "re-save the artifact.")
    header.pop("__metadata__", None)
    unexpected = sorted(set(header) - set(expected))
    if unexpected:
        raise ArtifactError(f"{where}: {name} has tensors that config.json does not list: {unexpected[:5]}. The two "
                            "files do not belong together; re-download or re-save the artifact.")
    data_bytes, ranges = size - 8 - n, []
    for key, entry in header.items():
        want = expected[key]
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list) or \
                not isinstance(entry.get("data_offsets"), list) or len(entry["data_offsets"]) != 2:
            raise ArtifactError(f"{where}: {name} entry {key!r} is malformed; re-download or re-save the artifact.")
        dtype, shape, (start, end) = entry.get("dtype"), entry["shape"], entry["data_offsets"]
        if dtype not in _FLOAT_DTYPES:
            raise ArtifactError(f"{where}: tensor {key!r} of {name} has dtype {dtype!r}; expected a floating-point "
                                "tensor (F32).")
        if tuple(shape) != tuple(want):
            raise ArtifactError(f"{where}: tensor {key!r} of {name} has shape {tuple(shape)}, expected {tuple(want)} "
                                "(config.json's head_dim / num_key_value_heads); the files do not belong together.")
        count = 1
        for s in want:
            count *= s
        if not all(isinstance(o, int) for o in (start, end)) or not 0 <= start <= end <= data_bytes or \
                end - start != count * _SAFETENSORS_ITEMSIZE[dtype]:
            raise ArtifactError(f"{where}: {name} is not a readable safetensors file: tensor {key!r} declares bytes "
                                f"{start}..{end}, which do not fit its shape or the {size}-byte file (truncated?); "
                                "re-download or re-save the artifact.")
        ranges.append((start, end, key))
    # The tensors tile the data exactly (the safetensors format has no gaps and no trailing bytes): whatever the
    # header does not account for would still be mapped by the loader (a long sparse tail exhausts address space).
    position = 0
    for start, end, key in sorted(ranges):
        if start != position:
            raise ArtifactError(f"{where}: {name} is not a readable safetensors file: tensor {key!r} starts at data "
                                f"byte {start}, but the tensors before it end at {position} (a gap or an overlap); "
                                "re-download or re-save the artifact.")
        position = end
    if position != data_bytes:
        raise ArtifactError(f"{where}: {name} has {data_bytes - position} bytes after its last tensor (the {size}-byte "
                            f"file's tensors end at byte {8 + n + position}); a safetensors file ends with its last "
                            "tensor. Re-download or re-save the artifact.")


def check_zoo_archive(path, where: str, head_dim: int | None = None, num_layers: int | None = None) -> None:
    """Check a RotationZoo ``.pt`` (a ``torch.save`` zip) before ``torch.load``, from its zip index alone (what
    ``torch.load`` allocates is what the index declares):

    * no entry inflates beyond the bytes it occupies in the file (``torch.save`` stores tensors uncompressed; a
      deflated entry lets a small file declare gigabytes of zeros);
    * every storage fits a float64 ``[d, d]`` rotation (``d`` the model's ``head_dim``, else :data:`MAX_HEAD_DIM`);
    * all entries together fit ``num_layers`` layers of float64 rotations + eigenvalues of the model's config, or
      :data:`MAX_ZOO_BYTES` without it.
    """
    path = Path(path)
    d = head_dim or MAX_HEAD_DIM
    per_storage = 8 * d * d
    total_cap = 8 * (d * d + d) * num_layers + (1 << 20) if head_dim and num_layers else MAX_ZOO_BYTES
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise ArtifactError(f"{where}: {path.name} is not a torch.save zip archive ({e}); RotationZoo files are "
                            "written with torch.save (PyTorch >= 1.6). Re-save it with torch.save.") from None
    for entry in entries:
        if "/data/" in entry.filename and entry.file_size > per_storage:
            raise ArtifactError(f"{where}: {path.name} declares a {entry.file_size}-byte tensor "
                                f"({entry.filename}), larger than a [{d}, {d}] float64 rotation "
                                f"({'the model' if head_dim else 'the largest supported'} head_dim {d}); refusing to "
                                "load it. Is this the RotationZoo for this model?")
    for entry in entries:
        if entry.file_size > entry.compress_size:
            raise ArtifactError(f"{where}: {path.name} stores {entry.filename} compressed ({entry.compress_size} "
                                f"bytes that inflate to {entry.file_size}); torch.save stores tensors uncompressed. "
                                "Refusing to load it; re-save the rotations with torch.save.")
    total = sum(entry.file_size for entry in entries)
    if total > total_cap:
        bound = (f"{num_layers} layers of [{d}, {d}] float64 rotations and eigenvalues (the model config's shapes)"
                 if head_dim and num_layers else
                 f"the {MAX_ZOO_BYTES} bytes an import reads without the model's config (pass config=model.config "
                 "to bound it by the model's shapes instead)")
        raise ArtifactError(f"{where}: {path.name} declares {total} bytes of data, more than {bound}; refusing to "
                            "load it. Is this the RotationZoo for this model?")
