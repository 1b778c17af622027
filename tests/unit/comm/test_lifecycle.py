"""comm/lifecycle.py without processes: why a graceful stop is requested."""

from dflash_dist.comm.lifecycle import KEY_STOP_REQUEST, Lifecycle


class Store:
    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode()

    def get(self, key):
        return self.values[key]

    def check(self, keys):
        return all(k in self.values for k in keys)


def test_stop_reason_is_this_ranks_signal_or_the_request_another_rank_posted():
    store = Store()
    target = Lifecycle(store, 1, "target", 2, install_handlers=False)
    drafter = Lifecycle(store, 0, "drafter", 2, install_handlers=False)
    assert target.stop_reason() is None and drafter.stop_reason() is None
    drafter.signal_name = "SIGTERM"  # what its handler sets
    assert drafter.stop_reason() == "SIGTERM"  # and posts the request
    assert store.values[KEY_STOP_REQUEST] == b"rank 0 (drafter): SIGTERM"
    assert target.stop_reason() == "rank 0 (drafter): SIGTERM"
