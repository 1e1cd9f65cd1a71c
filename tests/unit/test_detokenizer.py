from services.engine.core.detokenizer import Detokenizer

VOCAB = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!", 6: "\ufffd", 7: "é", 8: "EN", 9: "D"}


def decode(ids: list[int]) -> str:
    text = "".join(VOCAB[i] for i in ids)
    # token 6 is the first byte of a two-byte character completed by token 7
    return text.replace("\ufffdé", "é")


def run(ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], bool, str]:
    d = Detokenizer(decode, stop)
    deltas = []
    for n in range(1, len(ids) + 1):
        delta, stopped = d.step(ids[:n], final=n == len(ids))
        deltas.append(delta)
        if stopped:
            return deltas, True, d.text
    return deltas, False, d.text


def test_deltas_concatenate_to_the_text():
    deltas, stopped, text = run([1, 2, 3, 4, 5])
    assert "".join(deltas) == text == "Hello world!" and not stopped
    assert deltas[0] == "Hel"


def test_incomplete_character_is_held_back():
    deltas, _, text = run([1, 6, 7, 5])
    assert deltas[1] == "" and deltas[2] == "é" and "".join(deltas) == text == "Helé!"


def test_stop_string_spanning_tokens_ends_and_is_excluded():
    deltas, stopped, text = run([1, 2, 8, 9, 5], stop=("END",))
    assert stopped and text == "Hello" and "".join(deltas) == "Hello"
    assert "E" not in "".join(deltas)


def test_possible_stop_prefix_is_held_then_released():
    deltas, stopped, text = run([1, 2, 8, 5], stop=("END",))
    assert not stopped and text == "HelloEN!"
    assert deltas[2] == ""  # "EN" might start "END": held back
    assert "".join(deltas) == text


def test_resumed_detokenizer_emits_only_what_follows_the_delivered_text():
    # Another engine delivered "Hel" + "lo" and held back " wor" for the stop string " world!?".
    d = Detokenizer(decode, (" world!?",), emitted=len("Hello"))
    delta, _ = d.step([1, 2, 3, 4], final=False)
    assert delta == ""                      # " world" may still become the stop string
    delta, stopped = d.step([1, 2, 3, 4, 5], final=True)
    assert delta == " world!" and not stopped
