from decode_service.chat import MESSAGE_MODEL, encode_text
from decode_service.structured.vocab import encoded_vocab, stop_tokens, tokenizer_info


def test_encoded_vocab_is_the_tokenizers_bytes():
    vocab = encoded_vocab(201024)  # the padded embedding rows past the tokenizer get no bytes
    assert vocab[encode_text("hello")[0]] == b"hello"
    assert vocab[MESSAGE_MODEL] == b"<|message_model|>"
    assert vocab[201023] == b""


def test_tokenizer_info_is_built_once_per_vocab_and_stops():
    info = tokenizer_info(300, (5,))
    assert tokenizer_info(300, (5,)) is info
    assert info.vocab_size == 300 and info.stop_token_ids == [5]
    assert stop_tokens((200006,), (7, 200006)) == [7, 200006]
