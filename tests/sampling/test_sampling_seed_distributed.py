"""The secret batch seed agreed under tf.distribute without ``sampling_seed``: 63 bits from
the OS CSPRNG on the host, broadcast unchanged to every replica (before the fix: one 31-bit
draw summed over the replicas, R × draw, so always even on 2 replicas)."""

import json
import subprocess
import sys

WORKER = r'''
import json, os, secrets
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tf_dp.models.data import agreed_sampling_seed
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
seeds = [agreed_sampling_seed(strategy, None) for _ in range(40)]
known = 2**62 + 12345  # the host's draw, fixed: the agreed seed must be exactly it
secrets.randbits = lambda bits: known
per_replica = agreed_sampling_seed(strategy, None)
print(json.dumps({"seeds": seeds, "known": known, "agreed": per_replica,
                  "replicas": strategy.num_replicas_in_sync, "given": agreed_sampling_seed(strategy, 7)}))
'''


def test_agreed_sampling_seed_has_full_entropy_and_is_the_hosts_draw_on_every_replica():
    run = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    seeds = result["seeds"]
    assert result["replicas"] == 2
    assert any(seed % 2 for seed in seeds)  # all even with probability 2^-40
    assert max(seeds).bit_length() > 32  # all below 2^32 with probability 2^-1240
    assert all(0 <= seed < 2**63 for seed in seeds) and len(set(seeds)) == len(seeds)
    assert result["agreed"] == result["known"]  # the draw itself, not R × draw
    assert result["given"] == 7
