from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Kernel tests run many tiny ops; on a busy 2-core machine every multi-threaded
    op waits for a descheduled worker, which made this suite 20x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
