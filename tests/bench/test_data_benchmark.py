"""The data benchmark (llmtrain/bench/data_benchmark.py) on a tiny local corpus: every measurement is reported, and
the work per rank is what each path promises (a streamed rank tokenises the whole batch, a prepared one reads its
rows)."""

from __future__ import annotations

import json

from llmtrain.bench.data_benchmark import main
from llmtrain.data.sources import stdlib_files

SEQ_LEN, BATCH, DPS, RESUME_STEPS = 32, 8, (1, 2), (2, 40)


def _corpus(directory, chars: int = 300_000) -> None:
    """About `chars` characters of real text: every 20th standard-library file, one .txt document each."""
    written = 0
    for i, source in enumerate(stdlib_files()[::20]):
        with open(source, encoding="utf-8", errors="replace") as f:
            text = f.read()
        (directory / f"{i:03d}.txt").write_text(text)
        written += len(text)
        if written >= chars:
            return


def test_data_benchmark_reports_each_path_and_the_work_per_rank(tmp_path, capsys):
    _corpus(tmp_path)
    args = ["--source", "local", "--path", str(tmp_path), "--tokenizer", "byte", "--steps", "3"]
    args += ["--dp", ",".join(map(str, DPS)), "--resume-steps", ",".join(map(str, RESUME_STEPS))]
    # One preparing process and no minimum time keep it fast: the corpus is a few hundred KB.
    args += ["--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--min-seconds", "0", "--num-proc", "1"]
    main(args)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]

    (prepared_store,) = [r for r in rows if r["kind"] == "prepare"]
    assert prepared_store["train_tokens"] > 0 and prepared_store["tokens_per_s"] > 0

    throughput = {(r["path"], r["dp"]): r for r in rows if r["kind"] == "throughput"}
    assert set(throughput) == {(path, dp) for path in ("streaming", "prepared", "mixture") for dp in DPS}
    assert all(r["tokens_per_s_per_rank"] > 0 for r in throughput.values())
    for dp in DPS:
        # A prepared rank reads exactly its batch/dp rows per step; a streamed one tokenises the whole batch.
        assert throughput[("prepared", dp)]["tokens_read_per_rank_per_step"] == BATCH // dp * (SEQ_LEN + 1)
        assert throughput[("mixture", dp)]["tokens_read_per_rank_per_step"] == BATCH // dp * (SEQ_LEN + 1)
        assert throughput[("streaming", dp)]["tokens_tokenised_per_rank_per_step"] == BATCH * (SEQ_LEN + 1)
    read = [throughput[("prepared", dp)]["tokens_read_per_rank_per_step"] for dp in DPS]
    tokenised = [throughput[("streaming", dp)]["tokens_tokenised_per_rank_per_step"] for dp in DPS]
    assert read[0] == 2 * read[1] and tokenised[0] == tokenised[1]

    resume = {(r["path"], r["step"]): r for r in rows if r["kind"] == "resume"}
    assert set(resume) == {(path, step) for path in ("streaming", "prepared") for step in RESUME_STEPS}
    assert all(r["seconds"] > 0 and r["same_batch"] for r in resume.values())
