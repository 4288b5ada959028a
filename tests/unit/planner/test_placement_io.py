

def test_layer_gaps_lists_uncovered_spans() -> None:
    from helixserve.planner.placement import layer_gaps

    assert layer_gaps([(0, 4), (4, 8)], 8) == []
    assert layer_gaps([(0, 3), (5, 6)], 8) == [(3, 5), (6, 8)]
    assert layer_gaps([(2, 6), (0, 3)], 6) == []  # overlaps and any order
    assert layer_gaps([], 3) == [(0, 3)]
    assert layer_gaps([(-1, 20)], 4) == []  # clipped to the model
