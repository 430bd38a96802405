from node.coordinator.status import thin


def test_thin_keeps_short_series_and_the_newest_point():
    assert thin([1, 2, 3], 10) == [1, 2, 3]
    rows = list(range(1, 3002))
    out = thin(rows, 1000)
    assert len(out) <= 1000 and out[-1] == 3001 and out == sorted(out)
    gaps = {b - a for a, b in zip(out, out[1:])}
    assert gaps == {4}  # evenly spaced
