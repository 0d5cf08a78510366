import torch, time, statistics, warnings
warnings.filterwarnings("ignore")
from specdecode.models.loading import load_model
m = load_model("qwen2.5-coder-0.5b-instruct", dtype="bfloat16", quant="int4", with_tokenizer=False).model
ids = torch.randint(0, 1000, (1, 600))
def run(fwd, label):
    cache = m.new_cache(1, 700)
    fwd(ids[:, :500], torch.tensor([0]), cache, num_logits=0)
    ts = []
    for p in range(500, 540):
        t = time.perf_counter(); fwd(ids[:, p:p+1], torch.tensor([p]), cache); ts.append((time.perf_counter() - t) * 1e3)
    print(label, "median ms", round(statistics.median(ts[5:]), 2), "first", round(ts[0], 1), flush=True)
run(m, "eager")
t = time.perf_counter()
cm = torch.compile(m, dynamic=True)
try:
    run(cm, "compiled")
except Exception as e:
    print("compile failed", type(e).__name__, str(e)[:300])
print("total compile+run s", round(time.perf_counter() - t, 1))
