"""`bench.bench_audio_wire` on a 1 s clip: codes are ~100x fewer bytes than rows, and the rows it sums match."""

from __future__ import annotations

from bench.bench_audio_wire import main


def test_codes_are_two_orders_of_magnitude_smaller_than_rows(capsys):
    (row,) = main(["--seconds", "1", "--reps", "1"])
    assert row["frames"] == 20
    assert 20 * 4096 * 2 < row["rows_bytes_per_s"] < 20 * 4096 * 2 * 1.01  # bf16 rows + framing
    assert 20 * 80 < row["codes_bytes_per_s"] < 20 * 80 + 200  # one byte per code + header
    assert row["cache_codes_bytes_per_s"] < row["cache_rows_bytes_per_s"] / 90
    assert "ratio" in capsys.readouterr().out
