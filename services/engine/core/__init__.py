"""The per-model engine core: sequences, the scheduler and its KV block manager, detokenizing, the loop
and the executor it drives. Plain Python: no gRPC, no torch."""
