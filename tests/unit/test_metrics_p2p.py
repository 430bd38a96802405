"""The libp2p host's counters reach /metrics (per reason, read at each scrape), from a real P2PStats."""
from node.coordinator.metrics import CoordinatorMetrics
from node.p2p.stats import P2PStats


def test_p2p_counters_are_exported_per_reason_and_read_at_each_scrape():
    metrics, stats = CoordinatorMetrics(), P2PStats()
    metrics.watch_p2p(stats.snapshot)
    text = metrics.render().decode()
    assert "prime_p2p_bytes_served_total 0.0" in text  # exported before anything happened
    for _ in range(3):
        stats.count_dropped("rate_limited", peer="12D3KooWevil")
    stats.count_dropped("bad_signature", peer="12D3KooWevil")
    stats.count_refused("busy_peer")
    stats.count_aborted("request_timeout")
    stats.add_served("12D3KooWpeer", 4096, shard_done=True)
    text = metrics.render().decode()
    assert 'prime_p2p_announcements_dropped_total{reason="rate_limited"} 3.0' in text
    assert 'prime_p2p_announcements_dropped_total{reason="bad_signature"} 1.0' in text
    assert 'prime_p2p_requests_refused_total{reason="busy_peer"} 1.0' in text
    assert 'prime_p2p_streams_aborted_total{reason="request_timeout"} 1.0' in text
    assert "prime_p2p_bytes_served_total 4096.0" in text
    assert "12D3KooW" not in text  # no per-peer labels: the series do not grow with the swarm
