"""The torch-free core of a round: requests, queues, the memory manager, the policy, collect, the KV fence, reclaim."""
