"""Plain transformers, no codeferry: greedy tokens of a corpus model on the release its code
was written for. Run by ``test_corpus.py`` with the floors' Python:
``python _reference.py MODEL_DIR MAX_NEW_TOKENS PROMPT...``; prints a JSON list of each prompt's
new token ids."""

import json
import sys

import torch
import transformers
from _weights import head


def main() -> None:
    folder, new_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model_class = getattr(transformers, head(folder))  # as its users build it
    model = model_class.from_pretrained(folder, trust_remote_code=True).eval()
    out = []
    for prompt in prompts:  # one at a time: no padding, the code's own simplest path
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            tokens = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
        out.append(tokens[0, ids["input_ids"].shape[1]:].tolist())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
