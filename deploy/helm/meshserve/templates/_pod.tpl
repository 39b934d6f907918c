{{/*
Pod specs of the head and of a worker pool. The plain Deployments and the KubeRay RayCluster
embed the same specs, so both modes run identical containers.
*/}}

{{- define "meshserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ int .Values.securityContext.runAsUser }}
runAsGroup: {{ int .Values.securityContext.runAsGroup }}
fsGroup: {{ int .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "meshserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: {{ .Values.securityContext.readOnlyRootFilesystem }}
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/*
Environment shared by every container. HOME and the caches point into the /tmp emptyDir because
the root filesystem is read-only: Ray writes its session under /tmp/ray and its token under
~/.ray; Triton and FlashInfer cache compiled kernels under XDG_CACHE_HOME.
*/}}
{{- define "meshserve.commonEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /tmp/home
- name: XDG_CACHE_HOME
  value: /tmp/cache
- name: TRITON_CACHE_DIR
  value: /tmp/cache/triton
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
{{- with include "meshserve.rayTokenSecret" . }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.ray.authToken.key }}
{{- else }}
{{- /* Ray 2.60 turns token auth on for new clusters; workers would then lack the token. */}}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Volumes every pod has; call with (dict "root" $ "shm" SIZE "scratch" SIZE). */}}
{{- define "meshserve.commonVolumes" -}}
- name: scratch
  emptyDir:
    sizeLimit: {{ .scratch }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
- name: scripts
  configMap:
    name: {{ include "meshserve.fullname" .root }}-scripts
    defaultMode: 0555
{{- with .root.Values.model.pvc.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ . }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "meshserve.commonVolumeMounts" -}}
- name: scratch
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
- name: scripts
  mountPath: /etc/meshserve/scripts
  readOnly: true
{{- if .Values.model.pvc.claimName }}
- name: model
  mountPath: {{ .Values.model.pvc.mountPath }}
  readOnly: true
  {{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* One probe on grpc.health.v1 for the given service name; call with (dict "root" $ "service" NAME). */}}
{{- define "meshserve.healthProbe" -}}
{{- $v := .root.Values -}}
{{- if eq (include "meshserve.probeMode" .root) "grpc" -}}
grpc:
  port: {{ int $v.service.grpcPort }}
  service: {{ .service | quote }}
{{- else -}}
exec:
  command:
    - python3
    - /etc/meshserve/scripts/healthcheck.py
    - --port={{ int $v.service.grpcPort }}
    - --service={{ .service }}
    {{- /* a second under the kubelet's timeout, so the script reports before it is killed */}}
    - --timeout={{ max 1 (sub (int $v.probes.timeoutSeconds) 1) }}
    {{- if $v.tls.existingSecret }}
    - --tls-dir=/etc/meshserve/tls
    - --server-name={{ include "meshserve.tlsServerName" .root }}
    {{- end }}
    {{- if $v.auth.existingSecret }}
    - --token-file=/etc/meshserve/auth/token
    {{- end }}
{{- end }}
timeoutSeconds: {{ int $v.probes.timeoutSeconds }}
periodSeconds: {{ int $v.probes.periodSeconds }}
{{- end -}}

{{- define "meshserve.headPodSpec" -}}
{{- $v := .Values -}}
serviceAccountName: {{ include "meshserve.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ int $v.head.terminationGracePeriodSeconds }}
securityContext:
  {{- include "meshserve.podSecurityContext" . | nindent 2 }}
{{- with $v.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.head.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.head.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.head.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: head
    image: {{ include "meshserve.image" . }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: ["/usr/bin/tini", "--", "/bin/bash", "/etc/meshserve/scripts/head.sh"]
    envFrom:
      - configMapRef:
          name: {{ include "meshserve.fullname" . }}-config
    env:
      {{- include "meshserve.commonEnv" . | nindent 6 }}
      - name: RAY_NUM_CPUS
        value: {{ int $v.head.rayCpus | quote }}
    ports:
      - name: grpc
        containerPort: {{ int $v.service.grpcPort }}
        protocol: TCP
      - name: metrics
        containerPort: {{ int $v.service.metricsPort }}
        protocol: TCP
      {{- if $v.service.httpPort }}
      - name: http
        containerPort: {{ int $v.service.httpPort }}
        protocol: TCP
      {{- end }}
      - name: gcs
        containerPort: {{ int $v.ray.port }}
        protocol: TCP
      {{- if $v.ray.dashboard }}
      - name: dashboard
        containerPort: 8265
        protocol: TCP
      {{- end }}
    startupProbe:
      {{- include "meshserve.healthProbe" (dict "root" . "service" "") | nindent 6 }}
      failureThreshold: {{ int $v.probes.startupFailureThreshold }}
    livenessProbe:
      {{- include "meshserve.healthProbe" (dict "root" . "service" "") | nindent 6 }}
      failureThreshold: {{ int $v.probes.livenessFailureThreshold }}
    readinessProbe:
      {{- include "meshserve.healthProbe" (dict "root" . "service" "meshserve.v1.Inference") | nindent 6 }}
      failureThreshold: 3
    resources:
      requests:
        cpu: {{ int $v.head.cpus | quote }}
        memory: {{ $v.head.memory }}
      limits:
        cpu: {{ int $v.head.cpus | quote }}
        memory: {{ $v.head.memory }}
    securityContext:
      {{- include "meshserve.containerSecurityContext" . | nindent 6 }}
    volumeMounts:
      {{- include "meshserve.commonVolumeMounts" . | nindent 6 }}
      {{- if $v.tls.existingSecret }}
      - name: tls
        mountPath: /etc/meshserve/tls
        readOnly: true
      {{- end }}
      {{- if $v.auth.existingSecret }}
      - name: auth
        mountPath: /etc/meshserve/auth
        readOnly: true
      {{- end }}
      {{- if $v.metricsAuth.existingSecret }}
      - name: metrics-auth
        mountPath: /etc/meshserve/metrics-auth
        readOnly: true
      {{- end }}
volumes:
  {{- include "meshserve.commonVolumes" (dict "root" . "shm" $v.head.shmSize "scratch" $v.head.scratchSize) | nindent 2 }}
  {{- if $v.tls.existingSecret }}
  - name: tls
    secret:
      secretName: {{ $v.tls.existingSecret }}
      defaultMode: 0440
  {{- end }}
  {{- if $v.auth.existingSecret }}
  - name: auth
    secret:
      secretName: {{ $v.auth.existingSecret }}
      defaultMode: 0440
      items:
        - key: {{ $v.auth.key }}
          path: token
  {{- end }}
  {{- if $v.metricsAuth.existingSecret }}
  - name: metrics-auth
    secret:
      secretName: {{ $v.metricsAuth.existingSecret }}
      defaultMode: 0440
      items:
        - key: {{ $v.metricsAuth.key }}
          path: token
  {{- end }}
{{- end -}}

{{/* Call with (dict "root" $ "pool" NAME). */}}
{{- define "meshserve.workerPodSpec" -}}
{{- $root := .root -}}
{{- $v := .root.Values -}}
{{- $gpus := int $v.worker.gpus -}}
serviceAccountName: {{ include "meshserve.serviceAccountName" $root }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ int $v.worker.terminationGracePeriodSeconds }}
securityContext:
  {{- include "meshserve.podSecurityContext" $root | nindent 2 }}
{{- with $v.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.worker.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.worker.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.worker.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: worker
    image: {{ include "meshserve.image" $root }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: ["/usr/bin/tini", "--", "/bin/bash", "/etc/meshserve/scripts/worker.sh"]
    envFrom:
      - configMapRef:
          name: {{ include "meshserve.fullname" $root }}-config
    env:
      {{- include "meshserve.commonEnv" $root | nindent 6 }}
      - name: MESHSERVE_POOL
        value: {{ .pool }}
      - name: MESHSERVE_POOL_SLOTS
        value: {{ include "meshserve.slotsPerPod" (dict "root" $root "pool" .pool) | quote }}
      - name: RAY_NUM_CPUS
        value: {{ int $v.worker.cpus | quote }}
      - name: RAY_NUM_GPUS
        value: {{ $gpus | quote }}
    ports:
      - name: node-manager
        containerPort: {{ int $v.ray.nodeManagerPort }}
        protocol: TCP
      - name: object-manager
        containerPort: {{ int $v.ray.objectManagerPort }}
        protocol: TCP
    # The raylet listens on the node-manager port once the pod has joined the Ray cluster.
    startupProbe:
      tcpSocket:
        port: node-manager
      periodSeconds: {{ int $v.probes.periodSeconds }}
      failureThreshold: {{ int $v.probes.startupFailureThreshold }}
    livenessProbe:
      tcpSocket:
        port: node-manager
      periodSeconds: {{ int $v.probes.periodSeconds }}
      failureThreshold: {{ int $v.probes.livenessFailureThreshold }}
    readinessProbe:
      tcpSocket:
        port: node-manager
      periodSeconds: {{ int $v.probes.periodSeconds }}
    resources:
      requests:
        cpu: {{ int $v.worker.cpus | quote }}
        memory: {{ $v.worker.memory }}
        {{- if gt $gpus 0 }}
        {{ $v.worker.gpuResource }}: {{ $gpus | quote }}
        {{- end }}
      limits:
        cpu: {{ int $v.worker.cpus | quote }}
        memory: {{ $v.worker.memory }}
        {{- if gt $gpus 0 }}
        {{ $v.worker.gpuResource }}: {{ $gpus | quote }}
        {{- end }}
    securityContext:
      {{- include "meshserve.containerSecurityContext" $root | nindent 6 }}
    volumeMounts:
      {{- include "meshserve.commonVolumeMounts" $root | nindent 6 }}
volumes:
  {{- include "meshserve.commonVolumes" (dict "root" $root "shm" $v.worker.shmSize "scratch" $v.worker.scratchSize) | nindent 2 }}
{{- end -}}
