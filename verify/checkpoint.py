"""Verify a checkpoint without trusting whoever serves it: a directory or a coordinator/relay URL.

Unlike `unpack_checkpoint`, which stops at the first problem, this collects every failure (one line
each, `[code] detail`) so an operator sees the whole picture: signature, signer, parent chain, stray or
missing shard files, each shard's size/hash/decompression bound, and the reconstructed payload's
sha256 (for a delta, xor-delta or sparse-delta, only when the base payload is given). Never imports `node`.

URL form: `http://HOST:PORT/v1/checkpoints/STEP`; the manifest is `GET URL/manifest` and shard i is
`GET URL/shards/i`, both read with size limits (the manifest's bound, then each shard's `zsize`) and
timeouts. Redirects are followed only to http(s).
"""
from __future__ import annotations

import hashlib
import re
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.client import HTTPMessage
from pathlib import Path
from typing import IO, Any, Callable

from protocol.checkpoint import (MAX_MANIFEST_BYTES, CheckpointError, DirShardReader, Manifest, ShardDecoder,
                                 check_forward, check_parent, decompress_shard, load_manifest, open_base,
                                 read_manifest_bytes, resolve_base, scan_shard_dir, verify_shard, verify_signature)
from protocol.checkpoint.parallel import BufferPool, ordered_map
from protocol.checkpoint.reconstruct import ShardReader, pooled_reader

HTTP_TIMEOUT_S = 30.0
_STEP_IN_URL = re.compile(r"/v1/checkpoints/([0-9]+)$")


@dataclass
class Report:
    """Outcome of a verification. `ok` iff no failure; `notes` are limits of what could be checked."""

    source: str
    manifest: Manifest | None = None
    signer: str | None = None
    failures: list[str] = field(default_factory=list)
    codes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    shards_ok: int = 0
    payload_verified: bool = False

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, err: CheckpointError, prefix: str = "") -> None:
        self.codes.append(err.code)
        self.failures.append(f"[{err.code}] {prefix}{err.detail}")

    def summary(self) -> str:
        if self.manifest is None:
            return f"{self.source}: no usable manifest"
        what = self.manifest.describe()
        if self.ok:
            hashed = "payload sha256 verified" if self.payload_verified else "payload sha256 NOT checked"
            signer = (self.signer or "?")[:16]  # set whenever ok: a bad signature is a failure
            return f"valid: {what}, signed by {signer}…, {self.shards_ok} shards verified, {hashed}"
        return f"INVALID: {what}: {len(self.failures)} failure(s)"


# --- sources ------------------------------------------------------------------------------------------
class _NoUnsafeRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: HTTPMessage,
                         newurl: str) -> urllib.request.Request | None:
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise CheckpointError("io_error", f"refusing redirect to {newurl[:80]}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_opener = urllib.request.build_opener(_NoUnsafeRedirect)


def http_get(url: str, limit: int, *, what: str, shard: int | None = None,
             timeout: float = HTTP_TIMEOUT_S) -> bytes:
    """GET with a byte limit and a timeout; 404 is `missing_*`, anything above the limit is refused."""
    try:
        with _opener.open(urllib.request.Request(url, headers={"Accept-Encoding": "identity"}),
                          timeout=timeout) as resp:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise CheckpointError("shard_size" if shard is not None else "manifest_too_large",
                                      f"{what}: server announces {declared} bytes, limit {limit}", shard=shard)
            data: bytes = resp.read(limit + 1)
    except urllib.error.HTTPError as e:
        code = ("missing_shard" if shard is not None else "manifest_schema") if e.code == 404 else "io_error"
        raise CheckpointError(code, f"{what}: HTTP {e.code} from {url}", shard=shard) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CheckpointError("io_error", f"{what}: cannot fetch {url}: {reason}", shard=shard) from None
    if len(data) > limit:
        raise CheckpointError("shard_size" if shard is not None else "manifest_too_large",
                              f"{what}: more than the {limit} bytes allowed", shard=shard)
    return data


class UrlShardReader:
    """`reader(i) -> bytes` for `{base_url}/shards/{i}`, never reading more than the declared zsize."""

    def __init__(self, base_url: str, manifest: Manifest, timeout: float = HTTP_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.manifest = manifest
        self.timeout = timeout

    def __call__(self, index: int) -> bytes:
        return http_get(f"{self.base_url}/shards/{index}", self.manifest.shards[index].zsize,
                        what=f"shard {index}", shard=index, timeout=self.timeout)


def is_url(source: str) -> bool:
    return urllib.parse.urlsplit(str(source)).scheme in ("http", "https")


# --- the checks -------------------------------------------------------------------------------------
def _as_manifest(parent: Any, trusted_keys: set[str], report: Report) -> Manifest | None:
    if parent is None or isinstance(parent, Manifest):
        return parent
    try:
        if is_url(str(parent)):
            base_url = str(parent).rstrip("/").removesuffix("/manifest")
            manifest = Manifest.from_json_bytes(http_get(f"{base_url}/manifest", MAX_MANIFEST_BYTES,
                                                         what="parent manifest"))
        else:
            manifest = load_manifest(parent)
        verify_signature(manifest, trusted_keys)
        return manifest
    except CheckpointError as e:
        report.fail(e, prefix=f"parent {parent}: ")
        return None


def _check_shards_and_payload(report: Report, manifest: Manifest, reader: Callable[[int], bytes],
                              skip: set[int], base_payload: Any, threads: int, progress: bool) -> None:
    from tqdm import tqdm

    base = open_base(base_payload) if (base_payload is not None and manifest.is_delta) else None
    if base is not None and base.size != manifest.total_size:
        report.fail(CheckpointError("base_mismatch", f"base payload is {base.size} bytes but step "
                                                     f"{manifest.step} has {manifest.total_size}: wrong base"))
        if base is not base_payload:
            base.close()
        base = None
    # Without its base a delta's shards are still checked (size, hash, bounded decompression of what was
    # signed), but the payload they rebuild, and so its sha256, cannot be.
    can_hash = (not manifest.is_delta or base is not None) and not skip
    digest = hashlib.sha256()

    window = threads + 1
    buffers = BufferPool(manifest.raw_size(0), window + 1)
    decoder = ShardDecoder(manifest, reader, base) if can_hash else None
    read_shard = pooled_reader(manifest, reader)

    def check(index: int) -> bytearray:
        buf = buffers.acquire()
        try:
            if decoder is not None:
                decoder.decode_into(index, memoryview(buf)[:manifest.raw_size(index)])
            else:  # a delta without its base: verify and decompress (bounded) what was signed
                with read_shard(index) as data:
                    verify_shard(manifest, index, data)
                    block = buf if len(buf) >= manifest.shards[index].size else bytearray(manifest.shards[index].size)
                    decompress_shard(manifest, index, data, out=memoryview(block)[:manifest.shards[index].size])
        except BaseException:
            buffers.release(buf)
            raise
        return buf

    todo = [i for i in range(manifest.num_shards) if i not in skip]
    results = ordered_map(check, todo, threads=threads, window=window)
    try:
        with tqdm(total=manifest.total_size, unit="B", unit_scale=True, desc=f"verify step {manifest.step}",
                  file=sys.stderr, disable=not progress, leave=False) as bar:
            for index, fut in results:
                err = fut.exception()
                if err is not None:
                    if not isinstance(err, CheckpointError):
                        raise err
                    report.fail(err)
                    can_hash = False
                    continue
                report.shards_ok += 1
                buf = fut.result()
                raw = memoryview(buf)[:manifest.raw_size(index)]
                bar.update(len(raw))
                if can_hash:
                    digest.update(raw)
                raw.release()
                buffers.release(buf)
    finally:
        results.close()
        if base is not None and base is not base_payload:
            base.close()
    if can_hash:
        got = digest.hexdigest()
        if got == manifest.sha256:
            report.payload_verified = True
        else:
            hint = " (wrong base?)" if manifest.is_delta else ""
            report.fail(CheckpointError("payload_hash", f"reconstructed payload sha256 {got[:16]}… differs "
                                                        f"from the manifest's {manifest.sha256[:16]}…{hint}"))
    elif manifest.is_delta and base_payload is None:
        report.notes.append(f"payload sha256 not checked: step {manifest.step} is a {manifest.encoding} against "
                            f"step {manifest.base_step}; pass the base to check it")


def _verify(source: str, get_manifest: Callable[[], bytes], make_reader: Callable[[Manifest], ShardReader],
            scan: Callable[[Manifest], list[CheckpointError]] | None, trusted_keys: set[str], parent: Any,
            base: Any, previous: Manifest | None, threads: int, progress: bool,
            url_step: int | None = None) -> Report:
    report = Report(source=source)
    try:
        manifest = Manifest.from_json_bytes(get_manifest())
    except CheckpointError as e:
        report.fail(e)
        return report
    report.manifest = manifest
    if url_step is not None and url_step != manifest.step:
        report.fail(CheckpointError("step_mismatch", f"URL is for step {url_step} but the manifest is step "
                                                     f"{manifest.step}"))
    try:
        report.signer = verify_signature(manifest, trusted_keys)
    except CheckpointError as e:
        report.fail(e)
    parent_manifest = _as_manifest(parent, trusted_keys, report)
    for held, check in ((parent_manifest, check_parent), (previous, check_forward)):
        if held is not None:
            try:
                check(manifest, held)
            except CheckpointError as e:
                report.fail(e)
    skip: set[int] = set()
    if scan is not None:
        for problem in scan(manifest):
            report.fail(problem)
            if problem.shard is not None and problem.code in ("missing_shard", "bad_shard_name"):
                skip.add(problem.shard)
    with tempfile.TemporaryDirectory(prefix="prime-node-verify-") as work:
        base_payload = None
        if base is not None and manifest.is_delta:
            try:
                base_payload = resolve_base(base, trusted_keys, work, threads=threads, progress=progress)
            except CheckpointError as e:
                report.fail(e, prefix="base: ")
        elif base is not None:
            report.notes.append("--base ignored: the checkpoint is a full one")
        try:
            reader = make_reader(manifest)
        except CheckpointError as e:  # e.g. shards/ missing or a symlink (already reported by the scan)
            if f"[{e.code}] {e.detail}" not in report.failures:
                report.fail(e)
            return report
        _check_shards_and_payload(report, manifest, reader, skip, base_payload, threads, progress)
    return report


def verify_checkpoint_dir(path: str | Path, trusted_keys: set[str], parent: Any = None, base: Any = None, *,
                          previous: Manifest | None = None, threads: int = 2, progress: bool = False) -> Report:
    """Verify `path/manifest.json` and `path/shards/`, collecting every failure."""
    path = Path(path)
    return _verify(str(path), lambda: read_manifest_bytes(path), lambda m: DirShardReader(path, m),
                   lambda m: scan_shard_dir(path, m), trusted_keys, parent, base, previous, threads, progress)


def verify_checkpoint_url(url: str, trusted_keys: set[str], parent: Any = None, base: Any = None, *,
                          previous: Manifest | None = None, threads: int = 4, progress: bool = False,
                          timeout: float = HTTP_TIMEOUT_S) -> Report:
    """Verify `URL/manifest` and `URL/shards/{i}` (URL = http://HOST:PORT/v1/checkpoints/STEP)."""
    base_url = url.rstrip("/")
    if base_url.endswith("/manifest"):
        base_url = base_url[: -len("/manifest")]
    if urllib.parse.urlsplit(base_url).scheme not in ("http", "https"):
        raise CheckpointError("io_error", f"{url} is not an http(s) URL")
    match = _STEP_IN_URL.search(urllib.parse.urlsplit(base_url).path)
    return _verify(base_url,
                   lambda: http_get(f"{base_url}/manifest", MAX_MANIFEST_BYTES, what="manifest", timeout=timeout),
                   lambda m: UrlShardReader(base_url, m, timeout), None, trusted_keys, parent, base, previous,
                   threads, progress, url_step=int(match.group(1)) if match else None)


def verify_checkpoint(source: str | Path, trusted_keys: set[str], parent: Any = None, base: Any = None,
                      **kwargs: Any) -> Report:
    """Directory or URL, whichever `source` is."""
    if is_url(str(source)):
        return verify_checkpoint_url(str(source), trusted_keys, parent, base, **kwargs)
    return verify_checkpoint_dir(source, trusted_keys, parent, base, **kwargs)
