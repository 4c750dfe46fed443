"""Names in one-line messages (`tts_lightning.names`): a long list stays one short line, and a
mistyped name is answered with the one it most likely meant."""

from tts_lightning.names import some_names, unknown_names


def test_some_names_counts_what_it_leaves_out():
    speakers = [f"p{i:03d}" for i in range(100)]
    assert some_names(speakers) == "p000, p001, p002, p003, p004, p005, p006, p007 and 92 more"
    assert some_names(speakers[:8]) == "p000, p001, p002, p003, p004, p005, p006, p007"
    assert some_names(["alice"], shown=1) == "alice" and some_names([]) == ""


def test_unknown_names_guess_the_name_meant():
    known = ["alice", "bob", "p225", "p226"]
    # Another case first, then the closest spelling; nothing close: the name alone.
    assert unknown_names(["Alice"], known) == "'Alice' (did you mean 'alice'?)"
    assert unknown_names(["alcie", "bobby", "zed"], known) == (
        "'alcie' (did you mean 'alice'?), 'bobby' (did you mean 'bob'?), 'zed'"
    )
