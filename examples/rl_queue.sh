# Sourced by the comparison scripts (compare_losses.sh, train_inference_mismatch.sh): a queue of RL
# runs, JOBS of them at once in the background. Defines
#   queue_run NAME COMMAND...  keeps the finished run RUN_DIR/NAME, else starts COMMAND in the background
#   wait_runs                  waits for every run, prints their time, returns 1 when any failed
# Expects RUN_DIR, STEPS (a run's last step: its checkpoint marks it finished) and JOBS to be set.
# State shared by the two: the background runs' pids, whether one failed, and the
# time the queue began (the first queue_run).
queue_pids=()
queue_failed=0
queue_start=""

# Start COMMAND in the background for run NAME, unless a finished run of STEPS steps is there.
queue_run() {
    local name="$1"
    shift
    [ -n "$queue_start" ] || queue_start=$SECONDS
    if [ -d "$RUN_DIR/$name/checkpoints/step_$(printf '%08d' "$STEPS")" ]; then
        echo "   kept $name (finished earlier)"
        return
    fi
    # Events of an interrupted attempt would mix with the new run's.
    rm -rf "${RUN_DIR:?}/$name"
    # Wait for a free slot: whichever run ends first frees it.
    local ended pid alive
    while [ "${#queue_pids[@]}" -ge "$JOBS" ]; do
        wait -n -p ended "${queue_pids[@]}" || queue_failed=1
        alive=()
        for pid in "${queue_pids[@]}"; do
            [ "$pid" = "$ended" ] || alive+=("$pid")
        done
        queue_pids=("${alive[@]}")
    done
    echo "   start $name"
    "$@" &
    queue_pids+=("$!")
}

# Wait for every queued run and print how long the runs took; return 1 when any of them failed.
wait_runs() {
    local pid
    for pid in "${queue_pids[@]}"; do
        wait "$pid" || queue_failed=1
    done
    queue_pids=()
    echo "   RL runs took $(( SECONDS - ${queue_start:-$SECONDS} )) s"
    if [ "$queue_failed" != 0 ]; then
        echo "some RL runs failed (logs above); no plot" >&2
        return 1
    fi
}
