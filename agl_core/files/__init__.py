"""The files agl reads and writes beside a run: JSON lines (:mod:`.jsonl`), datasets in JSON lines or
parquet (:mod:`.datasets`) and the rollout recording (:mod:`.recording`)."""
