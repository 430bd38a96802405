"""The coordinator's PolicyStore under a replay: the training thread publishes while the verify thread replays (in
one process, or both in the engine process), and a new step reloads the oldest model in place. A replay's model is
leased: never reloaded while the replay runs (node/coordinator/verification.py)."""
from __future__ import annotations

import gc
import threading
import weakref

from node.coordinator.verification import PolicyStore
from node.worker.backends import GenRequest
from node.worker.backends.transformers_backend import TransformersBackend
from tests.integration.test_lora_serving import SAMPLING, verdicts
from tests.integration.test_verify_matrix import tiny_model, training_step


def test_a_replay_keeps_its_steps_weights_while_two_newer_steps_are_published(tmp_path):
    """Honest rollouts of step 0, replayed while the training thread publishes steps 2 and 3 into a store that keeps
    two: step 0 falls out of the window halfway through its replay. Before the lease the store reloaded that very
    model with step 3's weights (the replay's first forward was step 0's, the rest step 3's) and every rollout
    failed: an honest node banned."""
    models = [tiny_model(0)]
    for step in range(1, 4):
        models.append(training_step(models[-1], lr=3e-2, seed=step))
    models[0].save_pretrained(tmp_path / "model", safe_serialization=True)
    requests = [GenRequest([1 + i, 5, 9, 11], 100 + i) for i in range(8)]
    results = TransformersBackend(tiny_model(0)).generate(requests, **SAMPLING)

    store = PolicyStore(tmp_path / "model", keep=2)
    for step in (0, 1):
        store.put(step, models[step].state_dict())

    def publish_newer_steps(*_) -> None:  # the training thread, run to completion during the replay's first forward
        trainer = threading.Thread(target=lambda: [store.put(s, models[s].state_dict()) for s in (2, 3)])
        trainer.start()
        trainer.join()
        hook.remove()

    with store.lease(0) as model:
        assert model is not None
        hook = model.get_output_embeddings().register_forward_pre_hook(publish_newer_steps)
        replayed = verdicts(model, requests, results)
    assert store.steps() == [2, 3] and store.get(0) is None
    assert all(v.ok for v in replayed), [v.reason for v in replayed]
    assert not any(v.ok for v in verdicts(store.get(3), requests, results))  # step 3's weights really differ


def test_a_leased_model_out_of_the_window_is_freed_when_its_lease_ends(tmp_path):
    tiny_model(0).save_pretrained(tmp_path / "model", safe_serialization=True)
    state = tiny_model(1).state_dict()
    store = PolicyStore(tmp_path / "model", keep=2)
    store.put(0, state)
    store.put(1, state)
    with store.lease(0) as leased, store.lease(0) as again:
        assert leased is again is not None
        gone = weakref.ref(leased)
        store.put(2, state)  # a new model: step 0's is leased
        assert store.get(2) is not leased and store.steps() == [1, 2]
    del leased, again
    gc.collect()
    assert gone() is None  # dropped, not kept beside the window
    kept = {id(store.get(s)) for s in store.steps()}
    store.put(3, state)  # no lease: the oldest is reloaded in place again
    assert id(store.get(3)) in kept
    with store.lease(1) as none:
        assert none is None
