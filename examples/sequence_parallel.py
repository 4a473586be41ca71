import mlx.core as mx
import mlx_recgen as rg

group = mx.distributed.init()  # under mlx.launch: this process's rank; alone: a group of one
rank, size = group.rank(), group.size()
gla = rg.load_spec("gla")

B, L, H, K, V = 1, 1024, 4, 32, 32  # the whole sequence
mx.random.seed(0)  # every rank draws the same sequence here; a real job loads only its chunk
q, k = mx.random.normal((B, L, H, K)) / K**0.5, mx.random.normal((B, L, H, K)) / K**0.5
v, g = mx.random.normal((B, L, H, V)), mx.random.uniform(0.9, 1.0, (B, L, H))
h0 = mx.zeros((B, H, K, V))
cut = [L * r // size for r in range(size + 1)]  # rank r holds steps cut[r] .. cut[r + 1] - 1
chunk = [x[:, cut[rank]:cut[rank + 1]] for x in (q, k, v, g)]


def loss(q, k, v, g, h0):
    y, h = gla(q, k, v, g, initial_state=h0, return_state=True, group=group)
    # y: this rank's chunk; h: the state after the last chunk, the same on every rank (each
    # rank's loss counts it, so the ranks' losses add up to the loss of one process)
    return (y * y).sum() + h.sum() / size


value, grads = mx.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(*chunk, h0)
d_h0 = mx.distributed.all_sum(grads[4], group=group)  # like a parameter: summed over ranks
total = mx.distributed.all_sum(value, group=group)  # the loss of the whole sequence
mx.eval(grads, d_h0, total)
print(f"rank {rank} of {size}: steps {cut[rank]}..{cut[rank + 1] - 1}, total loss {total.item():.3f}")
