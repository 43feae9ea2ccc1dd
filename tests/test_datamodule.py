"""GRPODataModule options that fail at construction, before `Trainer.fit` starts ranks or the rollout child."""

from __future__ import annotations

import pytest

from lightning_grpo import GRPODataModule
from lightning_grpo.rollout.loop import GRPORolloutLoop


class NotALoop:
    pass


class MyLoop(GRPORolloutLoop):
    pass


@pytest.mark.parametrize(
    ("loop_cls", "named"),
    [
        ("no_such_pkg.loops.MyLoop", "no_such_pkg.loops.MyLoop"),
        ("test_datamodule.NotALoop", "is not a subclass of lightning_grpo.GRPORolloutLoop"),
        (NotALoop, "NotALoop"),
    ],
    ids=["not_importable", "path_to_other_class", "other_class"],
)
def test_a_loop_cls_that_is_not_a_rollout_loop_is_named(loop_cls, named):
    with pytest.raises(ValueError, match="loop_cls") as error:
        GRPODataModule(model="tiny-random", loop_cls=loop_cls)
    assert named in str(error.value)


def test_loop_cls_by_import_path_or_class():
    assert GRPODataModule(model="tiny-random", loop_cls="test_datamodule.MyLoop").loop_cls is MyLoop
    assert GRPODataModule(model="tiny-random", loop_cls=MyLoop).loop_cls is MyLoop
    assert GRPODataModule(model="tiny-random").loop_cls is None


def test_loop_kwargs_may_not_override_the_data_modules_own_options():
    with pytest.raises(ValueError, match=r"\['seed', 'temperature'\].*set them there"):
        GRPODataModule(model="tiny-random", loop_kwargs={"temperature": 0.1, "seed": 3, "tag": "mine"})
    assert GRPODataModule(model="tiny-random", loop_kwargs={"tag": "mine"}).loop_kwargs == {"tag": "mine"}
