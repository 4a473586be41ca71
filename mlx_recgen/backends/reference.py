"""The reference: the spec's forward step in a plain MLX loop, differentiated by MLX autodiff.

One call of the whole rendered forward step per time step, in the canonical layout, with no
checkpoints, no custom VJP and no compilation: what a user would write by hand.
"""

from __future__ import annotations

import mlx.core as mx

from ..layout import canonical_shape, from_canonical, reduce_to, to_canonical


def run_reference(rec, inputs, states, sizes, out_dtype):
    spec = rec.spec
    step = rec._backend("mlx").forward_step
    nb = len(spec.batch_axes)
    values = {}
    for t, x in zip(spec.inputs.values(), inputs):
        for c, part in enumerate(to_canonical(spec, t, x.astype(mx.float32))):
            values[(t.name, c)] = part
    shapes = {(t.name, c): canonical_shape(spec, t, sizes)
              for t in spec.states.values() for c in range(t.components)}
    state = {}
    for t, x in zip(spec.states.values(), states):
        for c, part in enumerate(to_canonical(spec, t, x.astype(mx.float32))):
            state[(t.name, c)] = mx.broadcast_to(part, shapes[(t.name, c)])
    key_of = {sym: (slot.tensor, slot.component) for slot, sym in spec.symbols.items()}
    ones = mx.ones((sizes[spec.state_axis] if spec.state_axis else 1,))
    outs = {(s.tensor, s.component): [] for s in spec.output_slots()}
    for i in range(sizes[spec.time]):
        args = [ones] if step.needs_state_ones else []
        for sym in step.args:
            key = key_of[sym]
            if key in state:
                args.append(state[key])
            else:
                x = values[key]
                args.append(x[(slice(None),) * nb + (i,)] if spec.inputs[key[0]].has_time else x)
        new_state = dict(state)
        for (kind, slot), r in zip(step.results, step.fn(*args)):
            key = (slot.tensor, slot.component)
            if kind == "state":
                new_state[key] = reduce_to(r, shapes[key])
            else:
                outs[key].append(r)
        state = new_state
    outputs = []
    for t in spec.outputs.values():
        shape = canonical_shape(spec, t, sizes, with_time=False)
        parts = [mx.stack([reduce_to(v, shape) for v in outs[(t.name, c)]], axis=nb)
                 for c in range(t.components)]
        outputs.append(from_canonical(spec, t, parts, reduce_missing=False).astype(out_dtype))
    finals = [from_canonical(spec, t, [state[(t.name, c)] for c in range(t.components)], False)
              for t in spec.states.values()]
    return outputs, finals
