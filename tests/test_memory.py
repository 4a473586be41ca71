"""Peak memory of forward + backward: the segment-checkpointed recurrence (seg=32) against
``mx.grad`` through a plain MLX loop that stores the state history (the hand reference), on a
state-dominated shape (SSD, B=1, H=4, P=32, N=64: a 32 KiB state per step, L=1024)."""

import mlx.core as mx

import mlx_recgen as rg
from references import ssd_inputs, ssd_ref, weighted_loss

L, SHAPE = 1024, dict(b=1, H=4, P=32, N=64)


def _peak_of_grad(loss, args):
    mx.eval(args)
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    grads = mx.grad(loss, argnums=tuple(range(len(args))))(*args)
    mx.eval(grads)
    peak = mx.get_peak_memory()
    del grads
    return peak - base, peak


def test_checkpointed_backward_uses_less_memory_than_stored_history(record_property):
    inputs, h0 = ssd_inputs(L=L, **SHAPE)
    Wy, Wh = mx.random.normal(inputs[0].shape), mx.random.normal(h0.shape)
    rec = rg.load_spec("ssd")

    def ours(*args):
        y, h = rec(*args[:-1], initial_state=args[-1], return_state=True, backend="mlx", seg=32)
        return weighted_loss(y, h, Wy, Wh)

    def stored_history(*args):
        y, h = ssd_ref(*args)
        return weighted_loss(y, h, Wy, Wh)

    args = inputs + [h0]
    ours_delta, ours_peak = _peak_of_grad(ours, args)
    ref_delta, ref_peak = _peak_of_grad(stored_history, args)
    assert ours_peak > 0 and ref_peak > 0, "this MLX build reports no peak memory"

    ratio = ref_delta / ours_delta
    state_mb = 4 * SHAPE["H"] * SHAPE["P"] * SHAPE["N"] * L / 2**20
    report = (f"peak memory of forward+backward at L={L}: stored-history loop "
              f"{ref_delta / 2**20:.1f} MiB, checkpointed seg=32 {ours_delta / 2**20:.1f} MiB, "
              f"ratio {ratio:.2f}x (the full state history is {state_mb:.1f} MiB)")
    print(report)
    record_property("memory_ratio", ratio)
    assert ratio > 3, report
