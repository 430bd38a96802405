"""What makes a shard cross libp2p in few Python trips (docs/P2P.md, "Shard throughput over libp2p"): the server's
write size against py-libp2p's own frame limits, and the yamux window-update patch (node/p2p/service.py). The
frames a real transfer takes are counted in tests/integration/test_p2p_shards.py."""
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import libp2p.security.noise.io as noise_io
import libp2p.stream_muxer.yamux.yamux as yamux

import node.p2p.service as service
from node.p2p import shard_server, shard_wire


def test_a_shard_write_is_one_yamux_frame_in_one_noise_message():
    """A write of CHUNK_BYTES must not be split by yamux (payload limit per frame) nor by Noise (plaintext limit
    per message, the yamux header included). 64 KiB writes crossed as 2 frames and 3 Noise messages."""
    assert shard_wire.NOISE_MAX_PLAINTEXT == noise_io.MAX_PLAINTEXT_LENGTH
    assert shard_wire.YAMUX_HEADER_BYTES == yamux.HEADER_SIZE
    chunk = shard_server.CHUNK_BYTES
    assert chunk <= yamux.MAX_MESSAGE_SIZE - yamux.HEADER_SIZE, "yamux would split a write into two frames"
    assert chunk + yamux.HEADER_SIZE <= noise_io.MAX_PLAINTEXT_LENGTH, "Noise would split a frame into two messages"
    assert chunk + yamux.HEADER_SIZE > noise_io.MAX_PLAINTEXT_LENGTH - 64, "writes much smaller than a frame waste trips"


def test_the_window_update_patch_still_targets_the_libp2p_in_use():
    """The patch replaces two module globals of py-libp2p's yamux; it only takes effect while upstream still calls
    them through those globals (libp2p==0.8.1). An upgrade that renames or inlines them fails here."""
    assert metadata.version("libp2p") == service.LIBP2P_PATCHED_VERSION, \
        "libp2p was upgraded: re-check patch_libp2p_yamux_window_updates' defect, then its target version"
    names = yamux.YamuxStream._auto_tune_and_send_window_update.__code__.co_names
    assert "_yamux_release_on_read" in names, "window updates no longer ask _yamux_release_on_read: the patch misses"
    assert "_py_yamux_env" in yamux._yamux_data_read_timeout.__code__.co_names


def test_importing_the_service_does_not_patch_yamux():
    code = ("import node.p2p.service, libp2p.stream_muxer.yamux.yamux as y; "
            "assert y._yamux_release_on_read(), 'yamux patched at import'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]


def unpatched(monkeypatch):
    """py-libp2p's own functions, as a fresh process has them (another test may have started a host); the
    module is restored after the test."""
    release = yamux._yamux_release_on_read
    monkeypatch.setattr(yamux, "_yamux_release_on_read", getattr(release, "replaced", release))
    monkeypatch.setattr(yamux, "_py_yamux_env", getattr(yamux._py_yamux_env, "__wrapped__", yamux._py_yamux_env))


def test_the_patch_batches_window_updates_once_and_reads_the_environment_once(monkeypatch):
    unpatched(monkeypatch)
    assert yamux._yamux_release_on_read()  # py-libp2p's default: credit after every read
    assert service.patch_libp2p_yamux_window_updates()
    installed = yamux._yamux_release_on_read
    assert not installed() and installed.batched
    assert service.patch_libp2p_yamux_window_updates()  # idempotent
    assert yamux._yamux_release_on_read is installed
    monkeypatch.setenv("PY_YAMUX_DATA_READ_TIMEOUT", "7")
    first = yamux._yamux_data_read_timeout()
    monkeypatch.setenv("PY_YAMUX_DATA_READ_TIMEOUT", "9")
    assert yamux._yamux_data_read_timeout() == first  # read once, not on every frame


def test_the_patch_steps_aside_when_upstream_changed(monkeypatch, caplog):
    monkeypatch.delattr(yamux, "_yamux_release_on_read")
    assert not service.patch_libp2p_yamux_window_updates()
    assert "window update is sent per read" in caplog.text


async def test_starting_a_host_installs_the_window_update_patch(monkeypatch):
    from node.p2p.host import P2PNode
    from protocol.identity import Identity
    from tests.p2p_helpers import p2p_config

    unpatched(monkeypatch)
    node = P2PNode(Identity.generate(), p2p_config(listen=False, allow_private_addrs=True), run_id="run-window")
    try:
        await node.start()
        assert getattr(yamux._yamux_release_on_read, "batched", False)
    finally:
        await node.stop()


async def test_starting_a_host_shortens_the_gil_switch_interval_but_never_lengthens_it(monkeypatch):
    """The trio thread waits for the GIL at every wake-up behind a busy generation thread (node/p2p/host.py,
    GIL_SWITCH_INTERVAL_S): a host lowers the process's switch interval to 1 ms, and leaves a lower one alone."""
    import sys

    from node.p2p import host
    from protocol.identity import Identity
    from tests.p2p_helpers import p2p_config

    before = sys.getswitchinterval()
    try:
        for given, expected in ((0.005, host.GIL_SWITCH_INTERVAL_S), (0.0002, 0.0002)):
            sys.setswitchinterval(given)
            node = host.P2PNode(Identity.generate(), p2p_config(listen=False), run_id="run-gil")
            try:
                await node.start()
                assert abs(sys.getswitchinterval() - expected) < 1e-6, (given, sys.getswitchinterval())
            finally:
                await node.stop()
    finally:
        sys.setswitchinterval(before)
