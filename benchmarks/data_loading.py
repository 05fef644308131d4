"""Data loading at scale (issue 14): Poisson loader throughput against the DP step it feeds,
and peak RSS of `fit` on 1 GB / 4 GB on-disk ArrayRecord datasets vs a one-batch baseline.

    python benchmarks/data_loading.py                     # everything (writes ~5 GB to a temp dir, then deletes it)
    python benchmarks/data_loading.py --parts=throughput  # loader vs step only
    python benchmarks/data_loading.py --parts=memory --sizes_gb=1,4

Throughput: examples/s served by `poisson_dataset` (index stream → parallel read →
optional augment), real rows only, after one warm-up batch; the DP step (ghost clipping,
σ = 1) of a model one would train on such data, timed by `fit` on in-memory arrays.
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

FLAGS = flags.FLAGS
flags.DEFINE_list("parts", ["throughput", "memory"], "Which parts to run.")
flags.DEFINE_integer("steps", 15, "Timed batches per throughput case.")
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


def dp_step_ms(build, x, y, batch: int, steps: int = 8) -> float:
    """Median DP step time of ``fit`` (arrays in memory, loader not the bottleneck)."""
    import keras
    import numpy as np

    import tf_dp

    model = tf_dp.DPModel(*build())
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    timer = StepTimer()
    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps + 2, sampling_seed=0, verbose=0,
              callbacks=[timer])
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


def imagenet_cnn():
    import keras

    inputs = keras.Input((224, 224, 3))
    h = keras.layers.Rescaling(1 / 255)(inputs)
    h = keras.layers.Conv2D(16, 8, strides=4, activation="relu")(h)
    h = keras.layers.Conv2D(32, 3, strides=2, activation="relu")(h)
    h = keras.layers.Conv2D(64, 3, strides=2, activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return inputs, keras.layers.Dense(100)(h)


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


def throughput() -> dict:
    import numpy as np
    import tensorflow as tf

    from tf_dp.models.data import poisson_dataset
    from tf_dp.sampling import RecordSource

    steps, rows = FLAGS.steps, []
    rng = np.random.default_rng(0)

    def case(name, batch, make_stream, step_ms=None):
        rate = loader_rate(make_stream(), steps)
        row = {"case": name, "L": batch, "loader_examples_per_s": round(rate, 1)}
        if step_ms is not None:
            row.update(dp_step_ms=round(step_ms, 2), dp_examples_per_s=round(batch / step_ms * 1e3, 1),
                       loader_over_step=round(rate / (batch / step_ms * 1e3), 2))
        print(json.dumps(row), flush=True)
        rows.append(row)

    # MNIST rows: arrays, and the TFDS ArrayRecord data source (records decoded by TFDS, then a transform)
    from tf_dp.data import load_mnist

    data = load_mnist(flatten=True)
    x, y = data.x_train, data.y_train
    mlp_ms = {b: dp_step_ms(mlp, x[:20000], y[:20000], b) for b in (256, 64)}
    for batch in (256, 64):
        case("mnist rows, arrays", batch, lambda: poisson_dataset(x, y, len(y), batch, None, seed=0), mlp_ms[batch])
    try:
        from tf_dp.data import tfds as dp_tfds

        data_dir = tempfile.mkdtemp(prefix="tf_dp_tfds_")
        start = time.perf_counter()
        dp_tfds.write_mnist(data_dir, limit=FLAGS.mnist_records)
        print(f"wrote {FLAGS.mnist_records} MNIST records to ArrayRecord in {time.perf_counter() - start:.1f} s")
        tfds_source = RecordSource(dp_tfds.mnist_source(data_dir), dp_tfds.mnist_flat_example)
        parsed = dp_tfds.mnist_examples(data_dir, flatten=True)
        for batch in (256, 64):
            case("mnist rows, tfds.data_source (ArrayRecord) + per-record transform", batch,
                 lambda: poisson_dataset(None, None, len(tfds_source), batch, None, seed=0, source=tfds_source),
                 mlp_ms[batch])
            case("mnist rows, ArrayRecord bytes parsed per batch in the graph (mnist_examples)", batch,
                 lambda: poisson_dataset(None, None, len(parsed), batch, None, seed=0, source=parsed), mlp_ms[batch])
        shutil.rmtree(data_dir, ignore_errors=True)
    except ImportError as error:
        print(f"skipped the TFDS case: {error}")

    # 32×32×3 uint8 images in memory, plain and with crop + flip (1 and 4 views)
    images = rng.integers(0, 255, (50000, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, 50000).astype(np.int32)
    cnn_ms = {b: dp_step_ms(cifar_cnn, images[:20000], labels[:20000], b) for b in (256, 64)}
    for batch in (256, 64):
        case("32x32x3 uint8, arrays", batch, lambda: poisson_dataset(images, labels, 50000, batch, None, seed=0),
             cnn_ms[batch])
        case("32x32x3 uint8, arrays + crop/flip", batch,
             lambda: poisson_dataset(images, labels, 50000, batch, None, seed=0, augment=crop_flip, augment_seed=0),
             cnn_ms[batch])
    case("32x32x3 uint8, arrays + crop/flip, K=4 views", 256,
         lambda: poisson_dataset(images, labels, 50000, 256, None, seed=0, augment=crop_flip, views=4, augment_seed=0))

    # 224×224×3 decoded from stored JPEG bytes
    records, mean_bytes = jpeg_records(20000)
    print(f"JPEG records: mean {mean_bytes / 1024:.1f} KiB")
    big = rng.integers(0, 255, (600, 224, 224, 3), dtype=np.uint8)
    big_labels = rng.integers(0, 100, 600).astype(np.int32)
    big_ms = {b: dp_step_ms(imagenet_cnn, big, big_labels, b, steps=4) for b in (64,)}
    for workers in (1, 2, 4):
        source = RecordSource(records, decode_pil, workers=workers)
        case(f"224x224x3 from JPEG, PIL decode, {workers} thread(s) per read", 64,
             lambda: poisson_dataset(None, None, len(records), 64, None, seed=0, source=source), big_ms[64])
    raw = RecordSource(records, lambda r: (r["jpeg"], np.int32(r["label"])))
    decode_tf = lambda s: tf.ensure_shape(tf.io.decode_jpeg(s, channels=3), [224, 224, 3])  # noqa: E731
    case("224x224x3 from JPEG, tf.io.decode_jpeg in the augment stage", 64,
         lambda: poisson_dataset(None, None, len(records), 64, None, seed=0, source=raw, augment=decode_tf), big_ms[64])
    return {"rows": rows}


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
    import numpy as np
    from array_record.python.array_record_module import ArrayRecordWriter

    record_bytes = 64 * 64 * 3 + 1
    count = int(gigabytes * 2**30 // record_bytes)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 255, (1024, record_bytes), dtype=np.uint8)  # synthetic images (+ a label byte)
    per_shard = -(-count // shards)
    for shard in range(shards):
        writer = ArrayRecordWriter(os.path.join(directory, f"images-{shard:05d}-of-{shards:05d}.array_record"),
                                   "group_size:1")
        for i in range(shard * per_shard, min(count, (shard + 1) * per_shard)):
            row = block[i % 1024].copy()
            row[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)  # every record distinct
            writer.write(row.tobytes())
        writer.close()
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
        output["throughput"] = throughput()
    if "memory" in FLAGS.parts:
        output["memory"] = memory()
    output[f"wall_seconds_{'+'.join(FLAGS.parts)}"] = round(time.perf_counter() - started, 1)
    os.makedirs(os.path.dirname(FLAGS.output), exist_ok=True)
    with open(FLAGS.output, "w") as handle:
        json.dump(output, handle, indent=1)
    print(f"wrote {FLAGS.output} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    app.run(main)
