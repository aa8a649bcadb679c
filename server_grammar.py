# server_grammar.py: structured output for server.py through llguidance (the Rust grammar engine guidance, vLLM and
# llama.cpp use): response_format json_object / json_schema, the `regex` and `grammar` (llama-server's GBNF, or Lark)
# extensions and forced tool calls become a token mask applied to one request's logits at each step, inside the
# Engine's batch (constrained and free requests share it). The vocabulary is read once from the tokenizer.
#
#     g = Grammars(tok, vocab_size)                      # lazily builds llguidance's tokenizer on first use
#     m = g.matcher(g.json_schema({"type": "object"}))   # one per request; raises GrammarError (-> 400) when invalid
#     logits = m.mask(logits); ...; m.consume(token)     # per step (engine thread)
import threading

import torch


class GrammarError(ValueError):
    """A grammar or schema llguidance refuses: the request's fault (400)."""


def _sentencepiece_wrapper(tok):
    """llguidance's TokenizerWrapper contract for a SentencePiece model: every id's bytes ("▁" -> space, <0xNN>
    byte pieces -> that byte, control tokens -> b"")."""
    sp = tok.sp

    class Wrapper:
        eos_token_id, bos_token_id = tok.eos_id, tok.bos_id
        special_token_ids = [i for i in range(sp.get_piece_size()) if sp.is_control(i)]
        tokens = []
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                tokens.append(bytes([int(piece[3:5], 16)]))
            elif sp.is_control(i) or sp.is_unknown(i):
                tokens.append(b"")
            else:
                tokens.append(piece.replace("\u2581", " ").encode())

        def __call__(self, s):
            return tok.encode(s if isinstance(s, str) else s.decode("utf-8", "replace"), bos=False)
    return Wrapper()


class Grammars:
    """The llguidance tokenizer of one model (built on first use: about half a second) and the grammar builders."""

    def __init__(self, tok, vocab_size: int):
        self.tok, self.vocab_size, self._lt, self._lock = tok, vocab_size, None, threading.Lock()

    def tokenizer(self):
        import llguidance as llg
        with self._lock:
            if self._lt is None:
                stops = sorted(self.tok.stop_ids)
                if getattr(self.tok, "hf", None) is not None:
                    self._lt = llg.LLTokenizer(self.tok.hf.to_str(), n_vocab=self.vocab_size, eos_token=stops)
                else:
                    from llguidance._tokenizer import TokenizerWrapper
                    self._lt = llg.LLTokenizer(TokenizerWrapper(_sentencepiece_wrapper(self.tok)),
                                               n_vocab=self.vocab_size, eos_token=stops)
            return self._lt

    @staticmethod
    def json_schema(schema) -> str:
        import llguidance as llg
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})  # compact JSON
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None

    @staticmethod
    def regex(pattern: str) -> str:
        import llguidance as llg
        return llg.LLMatcher.grammar_from_regex(pattern)

    @staticmethod
    def lark(text: str) -> str:
        import llguidance as llg
        return llg.LLMatcher.grammar_from_lark(text)

    @staticmethod
    def gbnf_or_lark(text: str) -> str:
        """llama-server's GBNF (`root ::= ...`), else Lark (`start: ...`)."""
        if "::=" in text:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                text = gbnf_to_lark(text)
            except Exception as e:  # noqa: BLE001 - the converter's own parse errors, reported as the request's fault
                raise GrammarError(f"invalid GBNF grammar: {e}") from None
        return Grammars.lark(text)

    def matcher(self, grammar: str) -> "Matcher":
        import llguidance as llg
        lt = self.tokenizer()
        err = llg.LLMatcher.validate_grammar(grammar, lt)
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"invalid grammar: {err}")
        return Matcher(llg.LLMatcher(lt, grammar, log_level=0), self.vocab_size)


class Matcher:
    """One request's grammar state. mask(logits [V]) -> the logits with every token the grammar forbids at -inf (once
    the grammar is complete only the stop tokens remain); consume(token) advances it."""

    def __init__(self, m, vocab_size: int):
        self.m, self.vocab = m, vocab_size
        self.bits = torch.full(((vocab_size + 31) // 32,), -1, dtype=torch.int32)
        self.shifts = torch.arange(32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        self.m.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        allowed = ((self.bits.unsqueeze(1) >> self.shifts) & 1).view(-1)[:logits.shape[-1]].bool()
        if not allowed.any():  # an error state: nothing is allowed, so let the request end
            raise GrammarError(f"the grammar reached a dead end: {self.m.get_error()}")
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def consume(self, token: int):
        self.m.consume_token(token)
