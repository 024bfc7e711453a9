"""The executor: interprets one worker's plan (its action list) step after step."""
