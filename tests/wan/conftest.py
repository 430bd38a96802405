"""Every test here builds a WAN lab of network namespaces; where one cannot be built, they skip with the reason."""
import pytest

from tests.wan.lab import unavailable

_why = None


def pytest_collection_modifyitems(config, items):
    global _why
    here = [i for i in items if "tests/wan/" in str(i.fspath).replace("\\", "/")]
    if not here:
        return
    _why = unavailable()
    for item in here:
        item.add_marker(pytest.mark.wan)
        if _why:
            item.add_marker(pytest.mark.skip(reason=_why))
