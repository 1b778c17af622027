#!/usr/bin/env bash
# Device call 13 on 2x H200 (< 5 min): the drafter-bound job of call 9 (256 anchors, project defaults: packed +
# compiled target) with rendezvous sends (the default since this call), then with topology.rendezvous_sends=false
# (payload sends posted at once, as before), target trace on in both: does the target's capture keep its time
# alone (~50-60 ms) and read as waiting when the drafter sets the pace, and what does it cost the job?
# (Run as two device calls on the same warm machine, 13 and 13b; this script does both.)
# Usage: bash bench/gpu_session13.sh OUT_DIR     (carry .whl)
source bench/gpu_env.sh "$@"   # strict mode, OUT (first argument), environment, helpers
rendezvous_pair ${PIPE_T:-150} pipeline_e2e_256 --steps 50 --warmup-steps 15 --override drafter.num_anchors=256
