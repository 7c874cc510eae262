"""One class per layout behind one protocol (runtime/layouts/protocol.py): prepare_job looks the
class up by the layout object and calls the same steps on every one."""

from __future__ import annotations

import pytest

from hetrain import DataParallel, Pipeline, TensorParallel
from hetrain.runtime.layouts.data import DataLayout
from hetrain.runtime.layouts.data_setup import DataSetup, TensorSetup
from hetrain.runtime.layouts.pipeline.layout import HybridSetup, PipelineSetup
from hetrain.runtime.layouts.pipeline.loop import PipelineLayout
from hetrain.runtime.layouts.protocol import Layout, RankLoop
from hetrain.runtime.layouts.tensor.loop import TensorLayout
from hetrain.runtime.setup import setup_for


@pytest.mark.parametrize("spec, world, cls, loop", [
    (DataParallel(sharding="fsdp"), 2, DataSetup, DataLayout),
    (TensorParallel(split="speed"), 2, TensorSetup, TensorLayout),
    (Pipeline(), 4, PipelineSetup, PipelineLayout),
    (Pipeline(stages=4), 4, PipelineSetup, PipelineLayout),     # k stages on k devices: one pipeline
    (Pipeline(stages=2), 4, HybridSetup, PipelineLayout),
    (Pipeline(stages="auto"), 4, HybridSetup, PipelineLayout),
])
def test_each_layout_object_has_its_own_class_behind_the_one_protocol(spec, world, cls, loop):
    layout = setup_for(spec, None, world_size=world)
    assert type(layout) is cls and layout.spec == spec and isinstance(layout, Layout)
    assert layout.loop_class is loop and issubclass(loop, DataLayout)
    assert isinstance(loop(None) if loop is not PipelineLayout else loop("pp", None, None), RankLoop)
    assert layout.blocks_compression is None or repr(spec) in layout.blocks_compression


def test_tensor_parallel_composes_a_data_parallel_part_instead_of_inheriting_it():
    tp = TensorSetup(TensorParallel(), None)
    assert not isinstance(tp, DataSetup) and isinstance(tp.data, DataSetup)
    for shared in ("split", "install"):          # measuring and the split, installing the wrapped model
        assert callable(getattr(tp.data, shared)) and not hasattr(tp, shared)


def test_a_sharding_asked_for_blocks_compression_and_the_planners_choice_does_not():
    assert DataSetup(DataParallel(), None).blocks_compression is None
    assert DataSetup(DataParallel(sharding="none"), None).blocks_compression is None
    assert DataSetup(DataParallel(sharding="zero1"), None).blocks_compression == \
        "parallel=DataParallel(sharding='zero1')"
