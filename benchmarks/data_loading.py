"""Data loading at scale: Poisson loader throughput against the DP step it feeds,
and peak RSS of `fit` on 1 GB / 4 GB on-disk ArrayRecord datasets vs a one-batch baseline.

    python benchmarks/data_loading.py                     # everything (writes ~5 GB to a temp dir, then deletes it)
    python benchmarks/data_loading.py --parts=throughput  # loader vs step only
    python benchmarks/data_loading.py --parts=throughput --groups=tfds,cifar --reps=3
    python benchmarks/data_loading.py --parts=memory --sizes_gb=1,4

Throughput: examples/s served by `poisson_dataset` (index stream → parallel read →
optional augment), real rows only, after one warm-up batch; the DP step (ghost clipping,
σ = 1) of a model one would train on such data, timed by `fit` on in-memory arrays — an
MLP for MNIST rows, a small CNN for 32×32×3, a ResNet-10 (keras-hub ResNetBackbone,
BatchNorm → GroupNorm by tf_dp.fix, patchify stem: see small_resnet) for 224×224×3. Steps and loaders are measured
alternately, --reps times, and the medians reported (2 shared cores: single runs vary ±30 %).
Memory: each case in a fresh subprocess; VmHWM (peak RSS) after `fit` of a small CNN
on 64×64×3 uint8 images read from ArrayRecord through a tf_dp record source.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/record.py, also when loaded by path
from record import write_json  # noqa: E402  (writes the command, commit, machine and date)

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["throughput", "memory"], "Which parts to run.")
flags.DEFINE_integer("steps", 15, "Timed batches per throughput case.")
flags.DEFINE_integer("reps", 3, "Repetitions: DP steps and loader cases measured alternately, medians reported.")
flags.DEFINE_list("groups", ["mnist", "tfds", "cifar", "imagenet", "grain"], "Throughput case groups to run.")
flags.DEFINE_list("sizes_gb", ["1", "4"], "On-disk dataset sizes for the memory part.")
flags.DEFINE_integer("memory_steps", 20, "fit steps per memory case.")
flags.DEFINE_integer("mnist_records", 20000, "MNIST examples written to ArrayRecord for the TFDS case.")
flags.DEFINE_string("output", "benchmarks/results/data_loading.json", "JSON output.")

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


# ------------------------------------------------------------------ throughput
def loader_rate(stream, steps: int) -> float:
    import tensorflow as tf

    iterator = iter(stream)
    next(iterator)
    start, rows = time.perf_counter(), 0.0
    for _ in range(steps):
        rows += float(tf.reduce_sum(next(iterator)["mask"]))
    return rows / (time.perf_counter() - start)


class StepTimer:
    def __new__(cls):
        import keras

        class Timer(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.times = []

            def on_train_batch_begin(self, batch, logs=None):
                self._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                self.times.append(time.perf_counter() - self._start)

        return Timer()


class DPStep:
    """The DP step (ghost clipping, σ = 1) of one model at one L, compiled once and timed
    by ``fit`` on in-memory arrays (the loader is not the bottleneck there); ``measure()``
    returns one median step time in ms (called once per repetition)."""

    def __init__(self, build, x, y, batch: int, steps: int = 8, physical_batch_size=None):
        import keras

        import tf_dp

        self.model = tf_dp.DPModel(*build())
        self.model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                           loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self.x, self.y, self.batch, self.steps, self.physical = x, y, batch, steps, physical_batch_size

    def measure(self) -> float:
        import numpy as np

        timer = StepTimer()
        self.model.fit(self.x, self.y, batch_size=self.batch, epochs=1, steps_per_epoch=self.steps + 2,
                       sampling_seed=0, verbose=0, callbacks=[timer], physical_batch_size=self.physical)
        return float(np.median(timer.times[2:]) * 1e3)


def mlp():
    import keras

    inputs = keras.Input((784,))
    return inputs, keras.layers.Dense(10)(keras.layers.Dense(256, activation="relu")(inputs))


def cifar_cnn():
    import keras

    inputs = keras.Input((32, 32, 3))
    h = keras.layers.Rescaling(1 / 255)(inputs)
    h = keras.layers.Conv2D(32, 3, strides=2, activation="relu")(h)
    h = keras.layers.Conv2D(64, 3, strides=2, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return inputs, keras.layers.Dense(10)(h)


def small_resnet():
    """A ResNet-10 for 224×224×3: keras-hub's ResNetBackbone constructor (basic blocks, one per
    stage, widths 64/64/128/256, BatchNormalization → GroupNormalization by tf_dp.fix) after a
    4×4/4 patchify stem (56×56 positions). The standard 7×7/2 stem has 112×112 = 12,544 output
    positions, above the 4,096 where the ghost engine switches a conv to its float64 Gram form
    for the rounding bound: [B, T, T] doubles (40 GB at B = 32) — out of memory here.
    keras.applications.ResNet50 has the same stem."""
    import keras
    import keras_hub

    import tf_dp

    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 64, 128, 256],
        stackwise_num_blocks=[1, 1, 1, 1], stackwise_num_strides=[1, 2, 2, 2], block_type="basic_block",
        image_shape=(56, 56, 32))
    inputs = keras.Input((224, 224, 3))
    h = keras.layers.Rescaling(1 / 255)(inputs)
    h = keras.layers.Conv2D(32, 4, strides=4, activation="relu")(h)
    outputs = keras.layers.Dense(100)(keras.layers.GlobalAveragePooling2D()(backbone(h)))
    fixed = tf_dp.fix(keras.Model(inputs, outputs))
    return fixed.inputs[0], fixed.outputs[0]


def crop_flip(x, seed):
    import tensorflow as tf

    padded = tf.pad(x, [[4, 4], [4, 4], [0, 0]])
    x = tf.image.stateless_random_crop(padded, [32, 32, 3], seed)
    return tf.image.stateless_random_flip_left_right(x, seed + 1)


def jpeg_records(count: int, size: int = 224):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    blobs = []
    for _ in range(16):  # smooth images (JPEG sizes like photos' rather than noise's)
        base = rng.integers(0, 255, (size // 8, size // 8, 3), dtype=np.uint8)
        image = Image.fromarray(base).resize((size, size), Image.BILINEAR)
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=90)
        blobs.append(buffer.getvalue())
    return [{"jpeg": blobs[i % 16], "label": i % 100} for i in range(count)], float(np.mean([len(b) for b in blobs]))


def decode_pil(record):
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(record["jpeg"])).convert("RGB")), np.int32(record["label"])


def mnist_numpy_record(record):  # the Python per-record transform of a TFDS-layout MNIST record
    import numpy as np

    return record["image"].reshape(784).astype(np.float32) / np.float32(255.0), np.int32(record["label"])


def mnist_tf_features(features):  # the same with TensorFlow ops: fit runs it in the graph
    import tensorflow as tf

    return tf.cast(tf.reshape(features["image"], [784]), tf.float32) / 255.0, tf.cast(features["label"], tf.int32)


def mnist_bytes_tf_features(features):  # write_mnist's layout (784 raw bytes), TensorFlow ops
    import tensorflow as tf

    pixels = tf.reshape(tf.io.decode_raw(features["image"], tf.uint8), [784])
    return tf.cast(pixels, tf.float32) / 255.0, tf.cast(features["label"], tf.int32)


def cifar_tfds(data_dir: str, count: int):
    """A CIFAR-shaped TFDS dataset: 32×32×3 PNG ``Image`` + ``ClassLabel``, supervised keys."""
    import numpy as np
    import tensorflow_datasets as tfds

    from tf_dp.data import tfds as dp_tfds

    rng = np.random.default_rng(1)
    base = rng.integers(0, 255, (64, 8, 8, 3), dtype=np.uint8)

    def examples():  # smooth images (PNG sizes like photos' rather than noise's)
        for i in range(count):
            image = np.repeat(np.repeat(base[i % 64], 4, 0), 4, 1)
            image = (image.astype(np.int32) + (i % 7)).clip(0, 255).astype(np.uint8)
            yield i, {"image": image, "label": i % 10}

    features = tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(32, 32, 3)),
                                           "label": tfds.features.ClassLabel(num_classes=10)})
    dp_tfds.write_dataset(data_dir, "tf_dp_bench_cifar", features, {"train": examples()},
                          supervised_keys=("image", "label"))
    return tfds.data_source("tf_dp_bench_cifar:1.0.0", split="train", data_dir=data_dir)


class Grain:
    """Grain worker processes doing the per-record Python work: each element of an
    ``IterDataset`` is one Poisson batch (the same indices as tf_dp's sampler), read by
    ``mp_prefetch`` workers through the MapDataset, stacked in the worker."""

    @staticmethod
    def stream(dataset, n: int, batch: int, workers: int):
        import grain
        import numpy as np

        from tf_dp.sampling import PoissonSampler

        sampler = PoissonSampler(n, batch, None, 0)

        def read_batch(step):
            indices, mask = sampler.batch(int(step))
            real = indices[mask == 1]
            pairs = [dataset[int(i)] for i in real]
            return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])

        # As tf_dp's loader: 2 batches in flight, a small buffer (grain's default buffer is 500 batches).
        steps = grain.MapDataset.range(10**6).map(read_batch)
        if workers:
            return steps.to_iter_dataset(grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)).mp_prefetch(
                grain.MultiprocessingOptions(num_workers=workers))
        return steps.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2))

    @staticmethod
    def rate(stream, steps: int) -> float:
        iterator = iter(stream)
        for _ in range(3):  # worker processes start (and import) before the first batch: not timed
            next(iterator)
        start, rows = time.perf_counter(), 0
        for _ in range(steps):
            rows += len(next(iterator)[1])
        return rows / (time.perf_counter() - start)


def throughput() -> dict:
    """Loader cases and DP steps measured alternately, FLAGS.reps times; medians reported."""
    import numpy as np
    import tensorflow as tf

    from tf_dp.models.data import poisson_dataset
    from tf_dp.sampling import RecordSource

    groups, steps, rng = set(FLAGS.groups), FLAGS.steps, np.random.default_rng(0)
    step_benches, cases, cleanup = {}, [], []

    def example_source(x, transform=None):  # what fit reads a tfds.data_source through
        from tf_dp.data import tfds as dp_tfds

        return dp_tfds.source_for_fit(x, transform) or RecordSource(x, transform)

    def stream_of(source, batch, **kw):
        return lambda: poisson_dataset(None, None, len(source), batch, None, seed=0, source=source, **kw)

    def add(name, batch, make_rate, step=None):
        cases.append((name, batch, make_rate, step))

    def loader(make_stream):
        return lambda: loader_rate(make_stream(), steps)

    if groups & {"mnist", "tfds"}:
        from tf_dp.data import load_mnist

        data = load_mnist(flatten=True)
        x, y = data.x_train, data.y_train
        for b in (256, 64):
            step_benches[f"mlp{b}"] = DPStep(mlp, x[:20000], y[:20000], b)
    if "mnist" in groups:
        for b in (256, 64):
            add("mnist rows, arrays", b, loader(lambda b=b: poisson_dataset(x, y, len(y), b, None, seed=0)), f"mlp{b}")
    if "tfds" in groups:
        import tensorflow_datasets as tfds

        from tf_dp.data import tfds as dp_tfds

        data_dir = tempfile.mkdtemp(prefix="tf_dp_tfds_")
        cleanup.append(data_dir)
        started = time.perf_counter()
        dp_tfds.write_mnist(data_dir, limit=FLAGS.mnist_records)
        dp_tfds.write_mnist_tfds_layout(data_dir, limit=FLAGS.mnist_records)
        print(f"wrote 2 x {FLAGS.mnist_records} MNIST records to ArrayRecord in {time.perf_counter() - started:.1f} s")
        raw_layout = dp_tfds.mnist_source(data_dir)
        png_layout = tfds.data_source("tf_dp_mnist_png:1.0.0", split="train", data_dir=data_dir)
        sources = {
            "mnist, write_mnist layout (784 raw bytes), tfds.data_source + Python per-record transform":
                RecordSource(raw_layout, dp_tfds.mnist_flat_example),
            "mnist, write_mnist layout, mnist_examples (hand-written graph parse)":
                dp_tfds.mnist_examples(data_dir, flatten=True),
            "mnist, write_mnist layout, fit's graph path (parsed_source + TF-ops transform)":
                example_source(raw_layout, transform=mnist_bytes_tf_features),
            "mnist, TFDS mnist layout (PNG Image), tfds.data_source + Python per-record transform":
                RecordSource(png_layout, mnist_numpy_record),
            "mnist, TFDS mnist layout (PNG Image), fit's graph path (parsed_source + TF-ops transform)":
                example_source(png_layout, transform=mnist_tf_features),
            "mnist, TFDS mnist layout (PNG Image), fit's graph path (supervised keys: uint8 image, label)":
                example_source(png_layout),
        }
        for b in (256, 64):
            for name, source in sources.items():
                add(name, b, loader(stream_of(source, b)), f"mlp{b}")
    if "cifar" in groups:
        import tensorflow_datasets  # noqa: F401

        images = rng.integers(0, 255, (50000, 32, 32, 3), dtype=np.uint8)
        labels = rng.integers(0, 10, 50000).astype(np.int32)
        data_dir = tempfile.mkdtemp(prefix="tf_dp_tfds_cifar_")
        cleanup.append(data_dir)
        png = cifar_tfds(data_dir, 20000)
        as_pair = lambda r: (r["image"], np.int32(r["label"]))  # noqa: E731
        for b in (256, 64):
            step_benches[f"cnn{b}"] = DPStep(cifar_cnn, images[:20000], labels[:20000], b)
            add("32x32x3 uint8, arrays", b, loader(lambda b=b: poisson_dataset(images, labels, 50000, b, None, seed=0)),
                f"cnn{b}")
            add("32x32x3 uint8, arrays + crop/flip", b, loader(
                lambda b=b: poisson_dataset(images, labels, 50000, b, None, seed=0, augment=crop_flip, augment_seed=0)),
                f"cnn{b}")
            add("32x32x3 PNG, tfds.data_source + Python per-record transform", b,
                loader(stream_of(RecordSource(png, as_pair), b)), f"cnn{b}")
            add("32x32x3 PNG, fit's graph path (parsed_source, supervised keys)", b,
                loader(stream_of(example_source(png), b)), f"cnn{b}")
            add("32x32x3 PNG, fit's graph path + crop/flip", b,
                loader(stream_of(example_source(png), b, augment=crop_flip, augment_seed=0)), f"cnn{b}")
        add("32x32x3 uint8, arrays + crop/flip, K=4 views", 256, loader(
            lambda: poisson_dataset(images, labels, 50000, 256, None, seed=0, augment=crop_flip, views=4,
                                    augment_seed=0)))
    if "imagenet" in groups or "grain" in groups:
        records, mean_bytes = jpeg_records(20000)
        print(f"JPEG records: mean {mean_bytes / 1024:.1f} KiB")
    if "imagenet" in groups:
        big = rng.integers(0, 255, (600, 224, 224, 3), dtype=np.uint8)
        big_labels = rng.integers(0, 100, 600).astype(np.int32)
        step_benches["resnet64"] = DPStep(small_resnet, big, big_labels, 64, steps=3, physical_batch_size=32)
        for workers in (1, 2):
            source = RecordSource(records, decode_pil, workers=workers)
            add(f"224x224x3 from JPEG, PIL decode, {workers} thread(s) per read", 64, loader(stream_of(source, 64)),
                "resnet64")
        raw = RecordSource(records, lambda r: (r["jpeg"], np.int32(r["label"])))
        decode_tf = lambda s: tf.ensure_shape(tf.io.decode_jpeg(s, channels=3), [224, 224, 3])  # noqa: E731
        add("224x224x3 from JPEG, tf.io.decode_jpeg in the augment stage", 64,
            loader(stream_of(raw, 64, augment=decode_tf)), "resnet64")
    if "grain" in groups:  # grain MapDataset with a Python map: tf_dp's loader (threads) vs grain worker processes
        import grain

        mnist_like = [{"image": rng.integers(0, 255, (28, 28, 1), dtype=np.uint8), "label": i % 10}
                      for i in range(20000)]
        datasets = {"MNIST-sized rows, numpy map": (grain.MapDataset.source(mnist_like).map(mnist_numpy_record), 256),
                    "224x224x3 JPEG, PIL map": (grain.MapDataset.source(records).map(decode_pil), 64)}
        for name, (dataset, b) in datasets.items():
            add(f"grain MapDataset ({name}), fit's loader: tf.data map + source threads", b,
                loader(stream_of(RecordSource(dataset), b)))
            for workers in (0, 2):
                grain_mode = f"mp_prefetch, {workers} worker processes" if workers else "in process, 2 threads"
                add(f"grain MapDataset ({name}), grain {grain_mode}",
                    b, lambda d=dataset, b=b, w=workers: Grain.rate(Grain.stream(d, len(d), b, w), steps))

    loader_runs = {i: [] for i in range(len(cases))}
    step_runs = {key: [] for key in step_benches}
    for rep in range(FLAGS.reps):  # alternate: every step, then every loader case, per repetition
        for key, bench in step_benches.items():
            step_runs[key].append(bench.measure())
            print(f"rep {rep} step {key}: {step_runs[key][-1]:.1f} ms", flush=True)
        for i, (name, batch, make_rate, _) in enumerate(cases):
            loader_runs[i].append(make_rate())
            print(f"rep {rep} {name}, L={batch}: {loader_runs[i][-1]:.0f} ex/s", flush=True)
    rows = []
    for i, (name, batch, _, step) in enumerate(cases):
        runs = loader_runs[i]
        row = {"case": name, "L": batch, "loader_examples_per_s": round(float(np.median(runs)), 1),
               "loader_runs": [round(r) for r in runs]}
        if step is not None:
            ms = float(np.median(step_runs[step]))
            row.update(step=step, dp_step_ms=round(ms, 2), dp_step_runs_ms=[round(t, 1) for t in step_runs[step]],
                       dp_examples_per_s=round(batch / ms * 1e3, 1),
                       loader_over_step=round(row["loader_examples_per_s"] / (batch / ms * 1e3), 2))
        print(json.dumps(row), flush=True)
        rows.append(row)
    for directory in cleanup:
        shutil.rmtree(directory, ignore_errors=True)
    return {"rows": rows, "reps": FLAGS.reps, "load_average_at_end": os.getloadavg()}


# ---------------------------------------------------------------------- memory
MEMORY_WORKER = r"""
import os, sys, json
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import keras, numpy as np, tf_dp
mode, path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
SHAPE = (64, 64, 3)
def build():
    inputs = keras.Input(SHAPE)
    h = keras.layers.Rescaling(1 / 255)(inputs)
    h = keras.layers.Conv2D(16, 4, strides=4, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = tf_dp.DPModel(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
def record_to_example(record):
    return np.frombuffer(record, np.uint8, count=64 * 64 * 3).reshape(SHAPE), np.int32(record[-1] % 10)
model = build()
if mode == "baseline":  # one batch's worth of examples in memory
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (512, *SHAPE), dtype=np.uint8); y = rng.integers(0, 10, 512).astype(np.int32)
    model.fit(x, y, batch_size=256, epochs=1, steps_per_epoch=steps, sampling_seed=0, verbose=0)
    n = 512
elif mode == "arrays":  # the same on-disk data loaded into memory first (what fit needed before)
    from array_record.python.array_record_data_source import ArrayRecordDataSource
    source = ArrayRecordDataSource(sorted(os.path.join(path, f) for f in os.listdir(path)))
    n = len(source)
    x = np.empty((n, *SHAPE), np.uint8); y = np.empty(n, np.int32)
    for start in range(0, n, 4096):
        for i, r in enumerate(source.__getitems__(list(range(start, min(n, start + 4096))))):
            x[start + i], y[start + i] = record_to_example(r)
    model.fit(x, y, batch_size=256, epochs=1, steps_per_epoch=steps, sampling_seed=0, verbose=0)
else:
    from array_record.python.array_record_data_source import ArrayRecordDataSource
    source = ArrayRecordDataSource(sorted(os.path.join(path, f) for f in os.listdir(path)))
    n = len(source)
    model.fit(source, transform=record_to_example, batch_size=256, epochs=1, steps_per_epoch=steps, sampling_seed=0,
              verbose=0)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across fork + exec, so a child would report its parent's peak.
print(json.dumps({"examples": n, "peak_rss_mb": int(status["VmHWM"].split()[0]) / 1024,
                  "rss_anon_mb_at_end": int(status["RssAnon"].split()[0]) / 1024,
                  "rss_file_mb_at_end": int(status["RssFile"].split()[0]) / 1024}))
"""


def write_array_record(directory: str, gigabytes: float, shards: int = 8) -> int:
    import keras
    import numpy as np
    from array_record.python.array_record_module import ArrayRecordWriter

    record_bytes = 64 * 64 * 3 + 1
    count = int(gigabytes * 2**30 // record_bytes)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 255, (1024, record_bytes), dtype=np.uint8)  # synthetic images (+ a label byte)
    per_shard = -(-count // shards)
    print(f"writing {gigabytes:g} GB of ArrayRecord ({count} records, {shards} shards):", flush=True)
    bar = keras.utils.Progbar(shards, unit_name="shard")  # minutes for the 4 GB source
    for shard in range(shards):
        writer = ArrayRecordWriter(os.path.join(directory, f"images-{shard:05d}-of-{shards:05d}.array_record"),
                                   "group_size:1")
        for i in range(shard * per_shard, min(count, (shard + 1) * per_shard)):
            row = block[i % 1024].copy()
            row[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)  # every record distinct
            writer.write(row.tobytes())
        writer.close()
        bar.add(1)
    return count


def run_memory_worker(mode: str, path: str) -> dict:
    run = subprocess.run([sys.executable, "-c", MEMORY_WORKER, mode, path, str(FLAGS.memory_steps)],
                         capture_output=True, text=True, timeout=1800)
    if run.returncode:
        raise RuntimeError(run.stderr[-3000:])
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps({"mode": mode, **result}), flush=True)
    return result


def memory() -> dict:
    results = {"baseline_one_batch_in_memory": run_memory_worker("baseline", "-")}
    for gigabytes in FLAGS.sizes_gb:
        directory = tempfile.mkdtemp(prefix="tf_dp_arrayrecord_")
        try:
            start = time.perf_counter()
            count = write_array_record(directory, float(gigabytes))
            size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
            print(f"wrote {count} records, {size / 2**30:.2f} GiB, in {time.perf_counter() - start:.0f} s", flush=True)
            entry = {"records": count, "bytes_on_disk": size, "source": run_memory_worker("source", directory)}
            if float(gigabytes) <= 1:
                entry["arrays_in_memory"] = run_memory_worker("arrays", directory)
            results[f"{gigabytes}GB"] = entry
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return results


def main(argv):
    del argv
    started = time.perf_counter()
    output = {}
    if os.path.exists(FLAGS.output):  # parts not run now keep their last results
        with open(FLAGS.output) as handle:
            output = json.load(handle)
    output.update({"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()})
    if "throughput" in FLAGS.parts:
        result = throughput()
        if set(FLAGS.groups) != {"mnist", "tfds", "cifar", "imagenet", "grain"} and "throughput" in output:
            run_cases = {n["case"] for n in result["rows"]}
            kept = [r for r in output["throughput"].get("rows", []) if r["case"] not in run_cases]
            result["rows"] = kept + result["rows"]  # groups not run keep their last results
        output["throughput"] = result
    if "memory" in FLAGS.parts:
        output["memory"] = memory()
    output[f"wall_seconds_{'+'.join(FLAGS.parts)}"] = round(time.perf_counter() - started, 1)
    write_json(FLAGS.output, output)
    print(f"wrote {FLAGS.output} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    app.run(main)
