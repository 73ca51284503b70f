"""`memcalc explain`: one row per saved tensor, with shape, width, splits and reason."""

from memcalc.model.ledger import BY_NAME

from . import memcalc_cli, shipped


def _rows(*args: str) -> dict[str, list[str]]:
    """The table's rows by tensor name (first cell, without the '(exact)' mark)."""
    run = memcalc_cli("explain", *args)
    assert (run.code, run.err) == (0, "")
    rows = {}
    for line in run.out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells and cells[0].split(" ")[0] in BY_NAME:
            rows[cells[0].split(" ")[0]] = cells
    return rows


def test_default_rows_are_the_seeds_fifteen_tensors():
    assert list(_rows()) == [
        "ln1/input", "attention/qkv_in", "attention/q", "attention/k", "attention/v",
        "attention/softmax_out", "attention/dropout_mask", "attention/dropout_out", "attention/proj_in",
        "attention/out_dropout_mask", "ln2/input", "mlp/fc1_in", "mlp/gelu_in", "mlp/fc2_in", "mlp/dropout_mask",
    ]


def test_each_row_gives_shape_width_splits_and_why():
    rows = _rows()
    name, saved_by, shape, width, tp, sp, why = rows["attention/softmax_out"]
    assert (shape, width, tp, sp) == ("(b, a, s, s)", "2", "yes (a/t)", "no")
    assert why.startswith("softmax backward")
    assert rows["ln1/input"][2:6] == ["(b, s, h)", "2", "no", "yes (s/t)"]
    assert rows["attention/dropout_mask"][3] == "1"


def test_exact_marks_the_terms_the_paper_leaves_out():
    rows = _rows("--exact")
    assert rows["ln1/mean"][0] == "ln1/mean (exact)"
    assert rows["ln1/mean"][2:6] == ["(b, s)", "4", "no", "yes (s/t)"]
    assert rows["ln1/input"][0] == "ln1/input"


def test_norm_statistics_on_cpu_take_the_activation_width():
    assert _rows("--exact", "--device", "cpu", "--dtype", "fp16")["ln2/rstd"][3] == "2"


def test_knob_flags_choose_the_rows():
    rows = _rows("--mlp", "swiglu", "--attention", "flash", "--dropout", "0")
    assert {"mlp/gate", "mlp/up", "mlp/silu_out"} <= set(rows)
    assert not {"mlp/gelu_in", "attention/softmax_out", "mlp/dropout_mask"} & set(rows)


def test_knobs_can_come_from_a_config_file():
    rows = _rows("--config", shipped("llama3-70b"))
    assert "mlp/gate" in rows and "ln1/input" in rows
    assert rows["attention/k"][4] == "yes (g/t)"


def test_what_the_sizes_change_is_named_under_the_table_as_estimate_counts_it():
    """Megatron's default layer (fused softmax) keeps no causal mask inside the kernel's window; estimate counts one
    at s = 7: explain names it, with the rule and the condition that decide, under the table."""
    run = memcalc_cli("explain", "--impl", "megatron")
    notes = [line for line in run.out.splitlines() if line.startswith("At some sizes: ")]
    assert len(notes) == 2 and "fused softmax window" in notes[0] and "(adds attention/causal_mask;" in notes[0]
    assert notes[1].startswith("At some sizes: attention/causal_mask: ")
    assert "attention/causal_mask" not in _rows("--impl", "megatron")
