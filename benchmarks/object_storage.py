"""Seconds per backup to object storage vs the local disk; s3fs vs obstore.

Starts a real S3-protocol server (`moto_server`) on 127.0.0.1 and measures,
side by side in one run (interleaved rounds, medians):

1. a synchronous `WorkerTrainingState.back_up()` of a ~5M-parameter MLP with
   Adam (a ~60 MB checkpoint): to a local directory, to the S3 server
   (`s3://`), and to fsspec's `memory://`; restore from each;
2. a raw upload of the same number of bytes with s3fs (what keras-ft uses,
   through fsspec) and with obstore (Rust), to see whether the client is
   what limits an upload.

The server runs on this machine and is itself Python (moto), so these are
upper bounds of keras-ft's own cost, not a cloud's throughput. Run with
`make bench` or `python benchmarks/object_storage.py [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
BUCKET = "keras-ft-bench"


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    moto = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    server = subprocess.Popen(
        [moto, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    return server, endpoint


def make_model():
    import keras

    model = keras.Sequential(
        [keras.Input((1024,)), keras.layers.Dense(2048), keras.layers.Dense(1024),
         keras.layers.Dense(2048), keras.layers.Dense(1)]
    )  # fmt: skip
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def backup_and_restore(model, target: str) -> tuple[float, float]:
    import keras_ft

    state = keras_ft.WorkerTrainingState(model, target, keep=1, async_save=False)
    state.lock()
    started = time.perf_counter()
    state.back_up(0)
    saved = time.perf_counter() - started
    started = time.perf_counter()
    state.restore()
    restored = time.perf_counter() - started
    state.delete_backup()
    return saved, restored


def raw_uploads(endpoint: str, payload: bytes, rounds: int) -> dict[str, list[float]]:
    import fsspec

    times: dict[str, list[float]] = {"s3fs": [], "obstore": []}
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    try:
        from obstore.store import S3Store

        store = S3Store(
            BUCKET, endpoint=endpoint, access_key_id="testing",
            secret_access_key="testing", region="us-east-1",
            client_options={"allow_http": True},
        )  # fmt: skip
    except ImportError:
        store = None
    with tempfile.NamedTemporaryFile() as f:
        f.write(payload)
        f.flush()
        for i in range(rounds):
            started = time.perf_counter()
            fs.put_file(f.name, f"{BUCKET}/raw/s3fs-{i}")
            times["s3fs"].append(time.perf_counter() - started)
            if store is not None:
                import obstore

                started = time.perf_counter()
                obstore.put(store, f"raw/obstore-{i}", payload)
                times["obstore"].append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    server, endpoint = start_server()
    try:
        import fsspec
        import keras

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir(BUCKET)
        model = make_model()
        params = model.count_params()
        local_root = tempfile.mkdtemp(prefix="keras-ft-bench-")
        targets = {
            "local disk": lambda i: os.path.join(local_root, f"b{i}"),
            "s3 (moto, loopback)": lambda i: f"s3://{BUCKET}/bench-{i}",
            "memory://": lambda i: f"memory://bench-{i}",
        }
        saves: dict[str, list[float]] = {k: [] for k in targets}
        restores: dict[str, list[float]] = {k: [] for k in targets}
        backup_and_restore(model, targets["local disk"]("warm"))  # One-time setup.
        for i in range(args.rounds):
            order = list(targets) if i % 2 == 0 else list(reversed(targets))
            for name in order:
                saved, restored = backup_and_restore(model, targets[name](i))
                saves[name].append(saved)
                restores[name].append(restored)
        shutil.rmtree(local_root, ignore_errors=True)
        checkpoint_bytes = 3 * params * 4
        uploads = raw_uploads(endpoint, os.urandom(checkpoint_bytes), args.rounds)
    finally:
        server.terminate()
        server.wait(timeout=30)

    med = statistics.median
    base_save, base_restore = med(saves["local disk"]), med(restores["local disk"])
    print(
        f"\nObject storage, {keras.backend.backend()}: {params / 1e6:.1f}M parameters "
        f"+ Adam = {checkpoint_bytes / 2**20:.0f} MB per checkpoint, "
        f"median of {args.rounds} rounds\n"
    )
    print("| where | seconds per save | × local | seconds per restore | × local |")
    print("|---|---|---|---|---|")
    for name in targets:
        print(
            f"| {name} | {med(saves[name]):.3f} | {med(saves[name]) / base_save:.1f} "
            f"| {med(restores[name]):.3f} | {med(restores[name]) / base_restore:.1f} |"
        )
    print(f"\nRaw upload of {checkpoint_bytes / 2**20:.0f} MB to the same server:\n")
    print("| client | seconds | MB/s |")
    print("|---|---|---|")
    for client, times in uploads.items():
        if times:
            print(
                f"| {client} | {med(times):.3f} | "
                f"{checkpoint_bytes / 2**20 / med(times):.0f} |"
            )
        else:
            print(f"| {client} | not installed | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
