"""What the checkpoint code may take from the engine: its public attributes and the block of
``settle_between_steps``, ``step_counts`` and ``entry_groups``, never a private attribute (the
engine's internals can then move without breaking saved checkpoints' code)."""
import ast
from pathlib import Path

import pytest

from checkpoint_helpers import _model, _train
from models import batches, lm_loss
from offload_zero import OffloadEngine

pytestmark = pytest.mark.usefixtures("torch_single_thread")
CHECKPOINT = Path(__file__).resolve().parents[1] / "offload_zero" / "checkpoint"


def _private_engine_uses(path: Path):
    """``(line, attribute)`` of every ``engine._<name>`` read or written in ``path``."""
    tree = ast.parse(path.read_text())
    return [(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and isinstance(node.value, ast.Name) and node.value.id == "engine"]


def test_checkpoint_code_uses_no_private_engine_attribute():
    files = sorted(CHECKPOINT.glob("*.py"))
    assert len(files) >= 6  # the package as laid out, not an empty folder
    found = {f.name: _private_engine_uses(f) for f in files}
    assert not {name: uses for name, uses in found.items() if uses}


def test_the_checkpoint_accessors_are_the_engines_own_state(tmp_path):
    """``step_counts`` is the dict the updates count in (a step adds one to each trainable flat
    parameter), and a load writes the saved counts into it; ``entry_groups`` gives each
    trainable flat parameter one group index per parameter."""
    with OffloadEngine(_model(0), offload="cpu", stage=3) as a:
        _train(a, batches(2))
        assert set(a.step_counts) == set(a.trainable)
        assert all(n == 2 for n in a.step_counts.values())
        assert all(groups == [0] * len(fp.entries) for fp, groups in a.entry_groups.items())
        a.save_checkpoint(tmp_path / "ckpt")
    with OffloadEngine(_model(1), offload="cpu", stage=3) as b:
        assert all(n == 0 for n in b.step_counts.values())
        b.load_checkpoint(tmp_path / "ckpt")
        assert all(n == 2 for n in b.step_counts.values())


def test_settle_between_steps_refuses_pending_gradients_and_a_closed_engine():
    eng = OffloadEngine(_model(0), offload="cpu", stage=3)
    x, y = batches(1)[0]
    eng.backward(lm_loss(eng(x), y))
    with pytest.raises(RuntimeError, match=r"\[rank 0\] my_save must run between steps"):
        eng.settle_between_steps("my_save")
    eng.step()
    eng.settle_between_steps("my_save")  # between steps: nothing to refuse
    eng.close()
    with pytest.raises(RuntimeError, match="this OffloadEngine is closed"):
        eng.settle_between_steps("my_save")
