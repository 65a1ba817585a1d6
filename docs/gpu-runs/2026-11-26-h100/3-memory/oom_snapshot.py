"""11-26 device call 3: who holds the H100's memory when a 32K prefill of the 8B shape runs out."""
import collections, os, pickle, sys, torch
OUT = os.environ["OUT"]
torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
fired = []

def oom(device, alloc, device_alloc, device_free):
    if fired:
        return
    fired.append(1)
    snap = torch.cuda.memory._snapshot()
    agg, count = collections.Counter(), collections.Counter()
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated":
                continue
            frames = [f for f in b.get("frames", []) if "kvcompress" in f["filename"] or "/transformers/" in f["filename"]]
            key = " < ".join(f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}"
                             for f in frames[:6])
            agg[key] += b["size"]; count[key] += 1
    print(f"OOM asking {alloc / 2**20:.0f} MiB, allocated {device_alloc / 2**30:.2f} GiB, free {device_free / 2**20:.0f} MiB")
    for key, size in agg.most_common(25):
        print(f"{size / 2**30:7.2f} GiB {count[key]:5d} blocks  {key}")
    sys.stdout.flush()
    # snapshot without the huge trace history
    snap.pop("device_traces", None)
    with open(os.path.join(OUT, "snap.pickle"), "wb") as f:
        pickle.dump(snap, f)

print("observer:", hasattr(torch._C, "_cuda_attach_out_of_memory_observer")); torch._C._cuda_attach_out_of_memory_observer(oom)
from kvcompress.cli import main
main(["bench", "speed", "--out", os.path.join(OUT, "d"), "--model", "llama-3.1-8b", "--methods", "full",
      "--lengths", "32768", "--batches", "1", "--steps", "2", "--warmup", "0"])
