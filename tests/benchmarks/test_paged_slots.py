"""benchmarks/paged_slots.py: full-length KV slots against slots sharing pages in the same room, the same tokens."""

import json

from benchmarks.paged_slots import main


def test_both_arms_decode_the_same_rows_and_the_paged_one_reports_its_work(tmp_path):
    out = tmp_path / "paged.json"
    result = main(
        ["--rows", "6", "--max-new-tokens", "140", "--room-rows", "2", "--slots", "6", "--repeats", "1"]
        + ["--json", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    full, paged = result["arms"]["full length"], result["arms"]["paged"]
    assert (full["slots"], full["pages"], paged["slots"]) == (2, None, 6)
    assert paged["pages"] == result["room_tokens"] // 64
    # (main exits if the arms sampled different tokens); a forward of the full-length arm holds at most its 2 slots
    assert full["rows_per_forward"] <= 2 and paged["decode_forwards"] > 0
