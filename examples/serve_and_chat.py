"""Starts the server, asks it one chat question through the official `openai` client, stops it.

    python examples/serve_and_chat.py                      # SmolLM2-135M-Instruct, tp=2 dp=2 DP attention
    python examples/serve_and_chat.py --model-path DIR --question "..." -- --max-total-tokens 4096

Arguments after `--` go to `python -m dpserve.launch_server` as they are.
"""

from __future__ import annotations

import argparse
import sys

from openai import OpenAI

from dpserve.testing.server import ServerProcess


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default="smollm2-135m-instruct", help="model to serve")
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size")
    parser.add_argument("--dp", type=int, default=2, help="DP attention groups")
    parser.add_argument("--question", default="What is the capital of France?", help="the user message")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer length limit")
    parser.add_argument("server_args", nargs="*", help="extra launch_server flags (after --)")
    args = parser.parse_args()
    launch = ["--model-path", args.model_path, "--tp", str(args.tp), "--dp", str(args.dp)]
    launch += ["--enable-dp-attention", *args.server_args] if args.dp > 1 else args.server_args
    print("starting: python -m dpserve.launch_server", " ".join(launch), flush=True)
    with ServerProcess(*launch) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model=args.model_path,
            messages=[{"role": "user", "content": args.question}],
            max_tokens=args.max_tokens,
            temperature=0,
        )
        print(f"Q: {args.question}\nA: {reply.choices[0].message.content}")
        print(
            f"usage: {reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens"
        )
        code = server.stop()
    print(f"server exited with code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
