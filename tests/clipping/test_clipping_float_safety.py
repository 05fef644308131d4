"""Floating-point safety of clipping: no input makes an example's released contribution
exceed C (docs/algorithms.md §6, "Floating point").

A seeded search over crafted inputs — large activations that cancel across positions
(x_t' = −x_t + δ), cancelling output gradients, huge and tiny scales, mixed signs, repeated
embedding ids — for every ghost rule. Each model is one trainable layer with the linear
loss ℓ_i = Σ_t ⟨z_it, r_it⟩, so the layer's inputs and output gradients (r) are exactly the
float32 values given and float64 numpy gives the exact per-example gradient. For each
candidate i the engine runs with mask e_i (its released contribution is then the whole
clipped sum) and, for some, on the full batch (the other crafted examples included) with
and without i.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.clipping import clipped_gradient_sum, dense

CANDIDATES = 32  # per kind; 15 kinds
HONEST = 4  # ordinary examples in every batch
TOLERANCE = 1e-3  # ‖released_i‖ ≤ C (1 + TOLERANCE)


def linear_loss(r, z):
    return tf.reduce_sum(tf.reshape(r * z, [tf.shape(z)[0], -1]), axis=1)


def _crafted_sequence(rng, steps, width, out):
    """(x [T, d], r [T, k]): a random pattern among cancelling pairs of positions in x or in r,
    scaled hugely or tinily, with mixed signs."""
    scale_x, scale_r = 10.0 ** rng.uniform(-12, 8), 10.0 ** rng.uniform(-8, 6)
    x = rng.standard_normal((steps, width)) * scale_x
    r = rng.standard_normal((steps, out)) * scale_r
    t, u = rng.choice(steps, 2, replace=False)
    eps = 2.0 ** -rng.integers(5, 24)
    if rng.random() < 0.5:  # x_u = −x_t (1 − ε) + tiny, r_u = r_t: Σ a sᵀ ≈ ε x_t r_tᵀ
        x[t] *= 10.0 ** rng.uniform(0, 6)
        x[u] = -x[t] * (1 - eps)
        r[u] = r[t]
    else:  # r_u = −r_t (1 − ε), x_u = x_t
        r[t] *= 10.0 ** rng.uniform(0, 6)
        r[u] = -r[t] * (1 - eps)
        x[u] = x[t]
    if rng.random() < 0.3:  # everything else small: the cancelling pair dominates
        keep = np.zeros(steps, bool)
        keep[[t, u]] = True
        x[~keep] *= 1e-6
    return x.astype("float32"), r.astype("float32")


def _honest_sequence(rng, steps, width, out):
    return rng.standard_normal((steps, width)).astype("float32"), rng.standard_normal((steps, out)).astype("float32")


def _batch(rng, make, *shape):
    pairs = [make(rng, *shape) for _ in range(CANDIDATES)] + [_honest_sequence(rng, *shape) for _ in range(HONEST)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def _dense_truth(x, r, bias=True):
    """Per-example [Σ_t x_t r_tᵀ, Σ_t r_t] in float64."""
    x, r = x.astype(np.float64), r.astype(np.float64)
    grads = [np.einsum("ptd,ptk->pdk", x, r)]
    return grads + [r.sum(axis=1)] if bias else grads


def dense_sequence(rng, steps=3, width=8, out=8):
    inputs = keras.Input((steps, width))
    model = keras.Model(inputs, keras.layers.Dense(out)(inputs))
    x, r = _batch(rng, _crafted_sequence, steps, width, out)
    return model, x, r, _dense_truth(x, r)


def dense_sequence_long(rng):
    return dense_sequence(rng, steps=12, width=3, out=3)  # T(d+k) > dk: the explicit products


def einsum_dense(rng, steps=4, width=6, out=5):
    inputs = keras.Input((steps, width))
    model = keras.Model(inputs, keras.layers.EinsumDense("abc,cd->abd", (steps, out), bias_axes="d")(inputs))
    x, r = _batch(rng, _crafted_sequence, steps, width, out)
    return model, x, r, _dense_truth(x, r)


def lora_dense(rng, steps=3, width=6, out=5):
    inputs = keras.Input((steps, width))
    layer = keras.layers.Dense(out)
    model = keras.Model(inputs, layer(inputs))
    layer.enable_lora(2, lora_alpha=4)
    layer.lora_kernel_b.assign(rng.standard_normal((2, out)).astype("float32"))
    x, r = _batch(rng, _crafted_sequence, steps, width, out)
    a, b, s = (np.asarray(v, np.float64) for v in (layer.lora_kernel_a, layer.lora_kernel_b, 2.0))
    x64, r64 = x.astype(np.float64), r.astype(np.float64)
    truth = {"lora_kernel_a": np.einsum("ptd,ptk->pdk", x64, s * r64 @ b.T),
             "lora_kernel_b": np.einsum("ptd,ptk->pdk", s * x64 @ a, r64), "bias": r64.sum(axis=1)}
    return model, x, r, [truth[v.name] for v in model.trainable_variables]


def _patches(images, size):
    """[P, T, size·size·C] valid stride-1 patches, in the kernel's (kh, kw, C) order."""
    p, h, w, c = images.shape
    rows = [images[:, i:i + size, j:j + size, :].reshape(p, -1)
            for i in range(h - size + 1) for j in range(w - size + 1)]
    return np.stack(rows, axis=1)


def conv(rng, channels=2, size=3, side=6, filters=3):
    inputs = keras.Input((side, side, channels))
    model = keras.Model(inputs, keras.layers.Conv2D(filters, size)(inputs))
    out_side = side - size + 1
    images, grads = [], []
    for i in range(CANDIDATES + HONEST):
        image = rng.standard_normal((side, side, channels))
        grad = rng.standard_normal((out_side, out_side, filters))
        if i < CANDIDATES:  # a huge checkerboard cancels across neighbouring patches
            checker = (-1.0) ** np.add.outer(np.arange(side), np.arange(side))[:, :, None]
            image = image * 10.0 ** rng.uniform(-6, 0) + checker * 10.0 ** rng.uniform(0, 12)
            grad = (np.ones_like(grad) + 1e-3 * grad) * 10.0 ** rng.uniform(-6, 6) if rng.random() < 0.7 else grad
        images.append(image)
        grads.append(grad)
    x, r = np.stack(images).astype("float32"), np.stack(grads).astype("float32")
    truth = _dense_truth(_patches(x, size), r.reshape(len(r), -1, filters))
    truth[0] = truth[0].reshape(len(r), size, size, channels, filters)
    return model, x, r, truth


def conv_single_channel(rng):
    return conv(rng, channels=1, size=3, side=7, filters=4)  # the grouped / depthwise route


def _crafted_ids(rng, steps, vocabulary, out):
    ids = rng.integers(0, vocabulary, steps)
    r = rng.standard_normal((steps, out)) * 10.0 ** rng.uniform(-8, 8)
    repeats = rng.choice(steps, rng.integers(2, steps + 1), replace=False)
    ids[repeats] = ids[repeats[0]]
    big = r[repeats[0]] * 10.0 ** rng.uniform(0, 10)
    r[repeats] = big * rng.choice([-1.0, 1.0], (len(repeats), 1))
    if len(repeats) % 2 == 0:
        r[repeats[-1]] = -r[repeats[:-1]].sum(axis=0) + big * 2.0 ** -rng.integers(5, 24)
    return ids, r.astype("float32")


def embedding(rng, steps=6, vocabulary=5, out=4):
    inputs = keras.Input((steps,), dtype="int32")
    model = keras.Model(inputs, keras.layers.Embedding(vocabulary, out)(inputs))
    pairs = [_crafted_ids(rng, steps, vocabulary, out) for _ in range(CANDIDATES)]
    pairs += [(rng.integers(0, vocabulary, steps), rng.standard_normal((steps, out)).astype("float32"))
              for _ in range(HONEST)]
    x, r = np.stack([p[0] for p in pairs]).astype("int32"), np.stack([p[1] for p in pairs])
    truth = np.zeros((len(x), vocabulary, out))
    for i in range(len(x)):
        np.add.at(truth[i], x[i], r[i].astype(np.float64))
    return model, x, r, [truth]


def layer_norm(rng, steps=3, width=6):
    inputs = keras.Input((steps, width))
    layer = keras.layers.LayerNormalization(epsilon=1e-3)
    model = keras.Model(inputs, layer(inputs))
    x, r = _batch(rng, _crafted_sequence, steps, width, width)
    x64 = x.astype(np.float64)
    normalized = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-3)
    r64 = r.astype(np.float64)
    return model, x, r, [(r64 * normalized).sum(axis=1), r64.sum(axis=1)]


def _crafted_table(rng, rows, features):
    """A batch-free [rows, f] table shared by every example: huge and tiny rows, pairs of
    equal rows (u_s = u_t) and of nearly opposite ones (u_q = −u_p (1 − ε))."""
    u = rng.standard_normal((rows, features)) * 10.0 ** rng.uniform(-6, 6, (rows, 1))
    if rows >= 4:
        t, s, p, q = rng.choice(rows, 4, replace=False)
        u[t] *= 10.0 ** rng.uniform(2, 8)
        u[s] = u[t]
        u[q] = -u[p] * (1 - 2.0 ** -rng.integers(5, 24))
    return u.astype("float32")


def _cancelling_grads(rng, u, out):
    """Per-example r [rows, k] whose Σ_t u_t r_tᵀ cancels on the table's equal/opposite row pairs."""
    rows = len(u)
    r = rng.standard_normal((rows, out)) * 10.0 ** rng.uniform(-8, 6)
    for t in range(rows):
        for s in range(t + 1, rows):
            if np.array_equal(u[s], u[t]) and rng.random() < 0.8:
                r[t] *= 10.0 ** rng.uniform(0, 6)
                r[s] = -r[t] * (1 - 2.0 ** -rng.integers(5, 24))
            elif np.allclose(u[s], -u[t], rtol=1e-3) and rng.random() < 0.8:
                r[s] = r[t]
    return r.astype("float32")


class _OnTable(keras.layers.Layer):
    """x + layer(table) (broadcast to the batch) or x · layer(table)ᵀ (a prototype head)."""

    def __init__(self, layer, table, prototypes=False, **kwargs):
        super().__init__(**kwargs)
        self.layer, self.table, self.prototypes = layer, table, prototypes

    def call(self, x):
        z = self.layer(keras.ops.convert_to_tensor(self.table))
        return tf.matmul(x, z, transpose_b=True) if self.prototypes else x + z


def dense_on_table(rng, rows=5, features=6, out=4, leading_one=False):
    """Dense on a batch-free [K, f] table, added to the batch's [P, K, k] (K = 1: [1, f] to [P, k])."""
    u = _crafted_table(rng, rows, features)
    inputs = keras.Input((out,) if leading_one else (rows, out))
    model = keras.Model(inputs, _OnTable(keras.layers.Dense(out), u)(inputs))
    r = np.stack([_cancelling_grads(rng, u, out) for _ in range(CANDIDATES + HONEST)])
    r = r[:, 0] if leading_one else r
    x = rng.standard_normal(r.shape).astype("float32")
    u_b = np.broadcast_to(u, (len(r), *u.shape))
    return model, x, r, _dense_truth(u_b, r.reshape(len(r), rows, out))


def dense_on_leading_one_table(rng):
    return dense_on_table(rng, rows=1, leading_one=True)


def dense_on_batch_sized_table(rng):
    return dense_on_table(rng, rows=CANDIDATES + HONEST, features=3, out=2)  # K = P


def prototype_head(rng, classes=5, features=6, width=4):
    """x · Dense(u)ᵀ, u a batch-free [K, f] table: ∂ℓ_i/∂W = (uᵀ r_i) x_iᵀ, ∂ℓ_i/∂b = (Σ_k r_ik) x_i."""
    u = _crafted_table(rng, classes, features)
    inputs = keras.Input((width,))
    model = keras.Model(inputs, _OnTable(keras.layers.Dense(width), u, prototypes=True)(inputs))
    r = np.stack([_cancelling_grads(rng, u, 1)[:, 0] for _ in range(CANDIDATES + HONEST)])
    x = (rng.standard_normal((len(r), width)) * 10.0 ** rng.uniform(-4, 4, (len(r), 1))).astype("float32")
    x64, r64, u64 = x.astype(np.float64), r.astype(np.float64), u.astype(np.float64)
    return model, x, r, [np.einsum("pk,kf,pe->pfe", r64, u64, x64), r64.sum(axis=1)[:, None] * x64]


def prototype_head_batch_sized(rng):
    return prototype_head(rng, classes=CANDIDATES + HONEST, features=3)  # K = P


def embedding_on_positions(rng, steps=6, vocabulary=5, out=4):
    """Embedding on batch-free [T] ids (repeated ids), added to the batch's [P, T, k]."""
    ids, _ = _crafted_ids(rng, steps, vocabulary, out)
    inputs = keras.Input((steps, out))
    model = keras.Model(inputs, _OnTable(keras.layers.Embedding(vocabulary, out), ids.astype("int32"))(inputs))
    table = np.eye(vocabulary)[ids]  # one-hot rows: equal rows where ids repeat
    r = np.stack([_cancelling_grads(rng, table, out) for _ in range(CANDIDATES + HONEST)])
    truth = np.zeros((len(r), vocabulary, out))
    for i in range(len(r)):
        np.add.at(truth[i], ids, r[i].astype(np.float64))
    return model, rng.standard_normal(r.shape).astype("float32"), r, [truth]


# (builder, force the Gram form by an explicit-products budget of 0, check the norm against
# the float64 truth: only where the layer's inputs are the given float32 values and the
# norm does not come from a float32 kernel's own per-example gradient)
KINDS = [
    (dense_sequence, True, True), (dense_sequence_long, False, True), (einsum_dense, True, True),
    (lora_dense, True, True), (conv, True, True), (conv, False, True), (conv_single_channel, False, False),
    (embedding, False, True), (layer_norm, False, False),
    # batch-free inputs ([1, f], [K, f] with K ≠ P and K = P, [T] ids): per-example gradients
    # replayed or taken through the whole model in float32, so their norm is that of what is released
    (dense_on_table, False, False), (dense_on_leading_one_table, False, False),
    (dense_on_batch_sized_table, False, False), (prototype_head, False, False),
    (prototype_head_batch_sized, False, False), (embedding_on_positions, False, False),
]


def _norms(grads):
    return np.sqrt(sum(np.sum(g.reshape(len(g), -1) ** 2, axis=1) for g in grads))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{k[0].__name__}{'_gram' if k[1] else ''}")
def test_no_released_contribution_exceeds_clip(monkeypatch, kind):
    build, force_gram, check_norm = kind
    if force_gram:
        monkeypatch.setattr(dense, "EXPLICIT_FLOATS", 0)
    rng = np.random.default_rng(20260 + KINDS.index(kind))
    model, x, r, truth = build(rng)
    true_norms = _norms(truth)
    batch = len(x)

    @tf.function
    def step(mask, clip):
        result = clipped_gradient_sum(model, linear_loss, tf.constant(x), tf.constant(r), mask, clip)
        return result.clipped_sums, result.squared_norms

    def released(mask, clip):
        sums, squared = step(tf.constant(mask, tf.float32), tf.constant(clip, tf.float32))
        return [s.numpy().astype(np.float64) for s in sums], squared.numpy().astype(np.float64)

    failures = []
    for i in range(CANDIDATES):
        clip = float(true_norms[i] * rng.uniform(0.05, 0.9))
        if not 0 < clip < 1e30:
            continue
        only_i = np.eye(batch, dtype="float32")[i]
        sums, squared = released(only_i, clip)
        contribution = np.sqrt(sum(np.sum(s ** 2) for s in sums))
        if not contribution <= clip * (1 + TOLERANCE):
            failures.append(f"#{i}: released {contribution / clip:.4g}·C (engine norm {np.sqrt(squared[i]):.4g}, "
                            f"true {true_norms[i]:.4g})")
        elif check_norm and not np.sqrt(squared[i]) >= true_norms[i] * (1 - 1e-6):
            failures.append(f"#{i}: engine norm {np.sqrt(squared[i]):.6g} below the true {true_norms[i]:.6g}")
        if i % 4 == 0:  # the full batch, every other crafted example included, with and without i
            with_i = np.ones(batch, "float32")
            without = with_i.copy()
            without[i] = 0.0
            delta = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(released(with_i, clip)[0],
                                                                       released(without, clip)[0])))
            if not delta <= clip * (1 + TOLERANCE):
                failures.append(f"#{i}: batch difference {delta / clip:.4g}·C")
    assert not failures, f"{len(failures)} of {CANDIDATES}: " + "; ".join(failures[:8])


LONG = 12544  # positions of a 224² image's first 7×7 stride-2 conv


def test_long_sequences_take_explicit_float64_products_never_a_t_by_t_gram():
    """T·u > 2⁻¹² (float32 beyond 4,096 positions): the explicit [P, d, k] products in float64,
    never the [P, T, T] Gram matrices (40 GB for 32 examples of a 224² image)."""
    @tf.function(input_signature=[tf.TensorSpec([32, LONG, 147]), tf.TensorSpec([32, LONG, 64])])
    def norms(a, s):
        return dense.DenseContribution(a, s, has_bias=True, flat=False).squared_norms()

    graph = norms.get_concrete_function().graph
    quadratic = [op.name for op in graph.get_operations()
                 for t in op.outputs if t.shape.rank == 3 and t.shape[1] == LONG and t.shape[2] == LONG]
    assert not quadratic, quadratic


def test_short_sequences_through_wide_kernels_take_the_gram_form_never_per_example_kernels():
    """T·(d + k) < d·k (FIBER's two evaluation points through a 512 × 512 kernel): the Gram
    matrices [P, T, T], never the [P, d, k] products (256 MB at P = 256, 7.8× FIBER's MLP step)."""
    @tf.function(input_signature=[tf.TensorSpec([32, 2, 512]), tf.TensorSpec([32, 2, 512])])
    def norms(a, s):
        return dense.DenseContribution(a, s, has_bias=True, flat=False).squared_norms()

    graph = norms.get_concrete_function().graph
    per_example_kernels = [op.name for op in graph.get_operations()
                           for t in op.outputs if t.shape.rank == 3 and t.shape[1:] == [512, 512]]
    assert not per_example_kernels, per_example_kernels


def _assert_sequence_dense_matches_float64(seed, steps, width, out, cancel):
    """Norms and clipped sums of Dense on [3, T, width] vs float64 per-example products;
    ``cancel(x)`` makes example 0's positions cancel."""
    rng = np.random.default_rng(seed)
    inputs = keras.Input((steps, width))
    model = keras.Model(inputs, keras.layers.Dense(out)(inputs))
    x = rng.normal(size=(3, steps, width)).astype("float32")
    cancel(x)
    r = rng.normal(size=(3, steps, out)).astype("float32")
    truth = _dense_truth(x, r)
    clip = float(np.median(_norms(truth)))
    result = clipped_gradient_sum(model, linear_loss, tf.constant(x), tf.constant(r), tf.ones(3), tf.constant(clip))
    np.testing.assert_allclose(np.sqrt(result.squared_norms.numpy()), _norms(truth), rtol=1e-5)
    factors = np.minimum(1.0, clip / _norms(truth))
    expected = [np.tensordot(factors, g, axes=1) for g in truth]
    for got, want in zip(result.clipped_sums, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


def test_short_sequence_gram_form_norms_and_clipped_sums_match_float64():
    steps, width, out = 2, 48, 40
    contribution = dense.DenseContribution(tf.zeros([3, steps, width]), tf.zeros([3, steps, out]), True, False)
    assert contribution._uses_gram_form()

    def cancel(x):
        x[0, 1] = -x[0, 0] + 1e-3

    _assert_sequence_dense_matches_float64(11, steps, width, out, cancel)


def test_long_sequence_norms_and_clipped_sums_match_float64():
    def cancel(x):
        x[0, 1::2] = -x[0, ::2] + 1e-3

    _assert_sequence_dense_matches_float64(7, 5000, 3, 2, cancel)
