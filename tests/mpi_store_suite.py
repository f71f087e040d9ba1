"""The store conformance suite against ``mpi://``; run only inside ``mpirun`` by test_store_mpi.py."""

import pytest

import pycollect as pc
from abstract import StoreSuite

pytestmark = pytest.mark.timeout(60)


class TestMPIStoreInMPI(StoreSuite):
    @pytest.fixture
    def store(self):
        with pc.plugins.open_store("mpi://", timeout=10) as store:
            assert store.server is not None and store.url.startswith("mpi://")
            yield store

    def test_a_rank_or_size_that_contradicts_mpi_is_refused(self):
        with pytest.raises(pc.InvalidArgument, match="MPI_COMM_WORLD says 1"):
            pc.plugins.open_store("mpi://", rank=0, size=4)
